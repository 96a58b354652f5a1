-- ARGV: prefix, before, batch. Returns {examined, removed}.
local p = ARGV[1]
local ks = redis.call('zrangebyscore', p .. 'idx:reqdone', '-inf', '(' .. ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, s in ipairs(ks) do
  if redis.call('hget', p .. 'req:' .. s, 'state') == 'done' then n = n + redis.call('del', p .. 'req:' .. s) end
  redis.call('zrem', p .. 'idx:reqdone', s)
end
return {#ks, n}
