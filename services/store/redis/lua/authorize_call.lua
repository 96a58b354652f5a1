-- uses: requests_lib
-- ARGV: prefix, token_hash, request_id, owner, now, nonce, call scope prefix, active status.
-- Returns {} for an unknown token; {data, version, last_active} when nothing is claimed; else
-- {data, version, last_active, created, state, owner, result, created_at, finished_at}.
local p, token, request_id = ARGV[1], ARGV[2], ARGV[3]
local id = redis.call('get', p .. 'tok:' .. token)
if not id then return {} end
local s = redis.call('hmget', p .. 's:' .. id, 'data', 'version', 'last_active', 'token')
-- The index and the record change in one script; checking again costs nothing and guards reads.
if not s[1] or s[4] ~= token then return {} end
local session = {s[1], s[2], s[3] or ''}
if request_id == '' or cjson.decode(s[1]).status ~= ARGV[8] then return session end
local scope = ARGV[7] .. id
local r = claim(p, request_key(scope, request_id), scope, request_id, ARGV[4], ARGV[5], ARGV[6])
for i = 1, 6 do session[3 + i] = r[i] end
return session
