-- uses: admission_lib
-- ARGV: prefix, account, slot_id.
local key = ARGV[1] .. 'admit:' .. ARGV[2]
if redis.call('exists', key) == 0 then return 0 end
local state = adm_load(key)
state.slots[ARGV[3]] = nil
adm_save(key, state)
return 0
