-- uses: requests_lib
-- ARGV: prefix, key, dead owner, owner, now, nonce. Returns {} for no record, else {taken, state, owner,
-- result, created_at, finished_at}; taken is 1 for our own retried takeover too (its nonce).
local p, key = ARGV[1], ARGV[2]
local r = request_fields(p, key)
if not r then return {} end
if r[1] == 'pending' and r[2] == ARGV[3] then
  redis.call('hset', p .. 'req:' .. key, 'owner', ARGV[4], 'created_at', ARGV[5], 'nonce', ARGV[6])
  return {1, 'pending', ARGV[4], '', ARGV[5], '0'}
end
local mine = 0
if r[1] == 'pending' and r[6] == ARGV[6] then mine = 1 end
return {mine, r[1], r[2], r[3], r[4], r[5]}
