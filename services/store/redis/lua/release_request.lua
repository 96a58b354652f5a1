-- ARGV: prefix, key
local k = ARGV[1] .. 'req:' .. ARGV[2]
if redis.call('hget', k, 'state') == 'pending' then redis.call('del', k) end
return 0
