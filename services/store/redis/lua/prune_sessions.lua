-- uses: sessions_lib
-- ARGV: prefix, closed_before, batch. Returns {examined, removed}.
local p = ARGV[1]
local ids = redis.call('zrangebyscore', p .. 'idx:closed', '-inf', '(' .. ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, id in ipairs(ids) do
  n = n + drop(p, id)
  redis.call('zrem', p .. 'idx:closed', id)
end
return {#ids, n}
