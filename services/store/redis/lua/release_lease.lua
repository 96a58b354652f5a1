-- ARGV: prefix, name, holder
local k = ARGV[1] .. 'lease:' .. ARGV[2]
if redis.call('get', k) == ARGV[3] then redis.call('del', k) end
return 0
