-- uses: admission_lib
-- ARGV: prefix, account, slot_id, run, priority, LIMITS (9). {admitted 0/1, wait_s, in_flight, rate, reason}.
local POLL_S = 0.05
local key = ARGV[1] .. 'admit:' .. ARGV[2]
local slot_id, run, priority = ARGV[3], ARGV[4], ARGV[5]
local limits = adm_limits(6)
local now = adm_now()
local state = adm_load(key)
adm_refresh(state, limits, now)
if state.slots[slot_id] then  -- this very admission, asked again (a reply lost): granted already
  adm_save(key, state)
  return {1, '0', adm_count(state.slots), tostring(state.rate), ''}
end
local wait, reason = 0.0, ''
local mine = state.waiting[run]
local since = now
if mine then since = mine[1] end
local in_flight = adm_count(state.slots)
local older = false
for r, v in pairs(state.waiting) do
  if r ~= run and v[1] < since then older = true end
end
if state.paused_until > now then
  wait, reason = state.paused_until - now, 'paused'
elseif in_flight >= limits.max_in_flight then
  wait, reason = POLL_S, 'in_flight'
elseif priority ~= 'urgent' and state.urgent_until > now then
  wait, reason = math.min(POLL_S, state.urgent_until - now), 'priority'
elseif priority == 'urgent' and older then
  wait, reason = math.min(POLL_S, 1.0 / state.rate), 'turn'
elseif state.tokens < 1.0 then
  wait, reason = (1.0 - state.tokens) / state.rate, 'rate'
end
if reason ~= '' then
  if priority == 'urgent' then
    state.waiting[run] = {since, now + limits.wait_ttl_s}
    state.urgent_until = math.max(state.urgent_until, now + limits.wait_ttl_s)
  end
  adm_save(key, state)
  return {0, tostring(wait), in_flight, tostring(state.rate), reason}
end
state.tokens = state.tokens - 1.0
state.slots[slot_id] = {run, now + limits.slot_ttl_s}
state.waiting[run] = nil
adm_save(key, state)
return {1, '0', in_flight + 1, tostring(state.rate), ''}
