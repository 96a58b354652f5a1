-- uses: sessions_lib
-- ARGV: prefix, id, data, token, run, labels, created, retain, last_active. 1 ok, 0 exists, -1 token taken.
local p, id = ARGV[1], ARGV[2]
local sk = p .. 's:' .. id
if redis.call('exists', sk) == 1 then
  if redis.call('hget', sk, 'data') == ARGV[3] then return 1 end  -- our own retried create
  return 0
end
if token_taken(p, id, ARGV[4]) then return -1 end
redis.call('hset', sk, 'data', ARGV[3], 'version', '1', 'token', ARGV[4], 'run', ARGV[5], 'labels', ARGV[6],
  'created', ARGV[7], 'retain', ARGV[8], 'last_active', ARGV[9])
index(p, id, ARGV[7], ARGV[4], ARGV[5], ARGV[6], ARGV[8])
return 1
