-- uses: admission_lib
-- ARGV: prefix, account, retry_after_s, LIMITS (9). The account's rate now (a string).
local key = ARGV[1] .. 'admit:' .. ARGV[2]
local retry_after = tonumber(ARGV[3])
local limits = adm_limits(4)
local now = adm_now()
local state = adm_load(key)
adm_refresh(state, limits, now)
if now - state.cut_at >= limits.cut_window_s then
  state.rate = math.max(limits.min_rate, state.rate * limits.cut_factor)
  state.cut_at = now
end
state.paused_until = math.max(state.paused_until, now + math.max(0.0, retry_after))
state.tokens = math.min(state.tokens, 0.0)
adm_save(key, state)
return tostring(state.rate)
