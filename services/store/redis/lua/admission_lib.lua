-- Create admission (rlgate.store.admission, which this mirrors step for step): one JSON record per account.
-- LIMITS: max_in_flight, max_rate, min_rate, burst, recover_per_s, slot_ttl_s, wait_ttl_s, cut_factor,
-- cut_window_s, as ARGV strings from position `at`.
local function adm_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function adm_limits(at)
  return {
    max_in_flight = tonumber(ARGV[at]), max_rate = tonumber(ARGV[at + 1]), min_rate = tonumber(ARGV[at + 2]),
    burst = tonumber(ARGV[at + 3]), recover_per_s = tonumber(ARGV[at + 4]), slot_ttl_s = tonumber(ARGV[at + 5]),
    wait_ttl_s = tonumber(ARGV[at + 6]), cut_factor = tonumber(ARGV[at + 7]), cut_window_s = tonumber(ARGV[at + 8]),
  }
end

local function adm_load(key)
  local raw = redis.call('get', key)
  if not raw then
    return {tokens = -1.0, at = 0.0, rate = 0.0, paused_until = 0.0, urgent_until = 0.0, cut_at = 0.0,
            slots = {}, waiting = {}}
  end
  return cjson.decode(raw)
end

local function adm_save(key, state)
  -- An empty Lua table encodes as {} (an object), which is what slots and waiting are.
  redis.call('set', key, cjson.encode(state))
end

local function adm_refresh(state, limits, now)
  local slots, waiting = {}, {}
  for k, v in pairs(state.slots) do if tonumber(v[2]) > now then slots[k] = v end end
  for k, v in pairs(state.waiting) do if v[2] > now then waiting[k] = v end end
  state.slots, state.waiting = slots, waiting
  if state.tokens < 0 then
    state.tokens, state.rate, state.at = limits.burst, limits.max_rate, now
    return
  end
  local elapsed = math.max(0.0, now - math.max(state.at, state.paused_until))
  state.rate = math.max(limits.min_rate, math.min(limits.max_rate, state.rate + limits.recover_per_s * elapsed))
  state.tokens = math.min(limits.burst, state.tokens + state.rate * elapsed)
  state.at = math.max(state.at, now)
end

local function adm_count(t)
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n
end
