-- ARGV: prefix, name, holder, ttl_ms. 1 if holder now holds the lease (taken or renewed).
local k = ARGV[1] .. 'lease:' .. ARGV[2]
local cur = redis.call('get', k)
if (not cur) or cur == ARGV[3] then
  redis.call('set', k, ARGV[3], 'PX', ARGV[4])
  return 1
end
return 0
