-- update(p, a, i): compare-and-set a session from a[i .. i+9] = id, expected, new_version, data, token, run,
-- labels, created, retain, last_active. Returns code, last_active (or the stored version when code is 0),
-- retried: code 1 ok, 0 version moved on, -1 token taken, -2 no such session; retried is true when the
-- stored record already is this very update (a retry after a lost reply).
local function update(p, a, i)
  local id, expected, new_version, data = a[i], a[i + 1], a[i + 2], a[i + 3]
  local token, run, labels, created, retain = a[i + 4], a[i + 5], a[i + 6], a[i + 7], a[i + 8]
  local sk = p .. 's:' .. id
  local cur = redis.call('hmget', sk, 'version', 'data', 'token', 'run', 'labels', 'last_active')
  if not cur[1] then return -2, '', false end
  if cur[1] ~= expected then
    if cur[1] == new_version and cur[2] == data then return 1, cur[6], true end
    return 0, cur[1], false
  end
  if token_taken(p, id, token) then return -1, '', false end
  unindex(p, id, cur[3], cur[4], cur[5])
  local last = a[i + 9]
  if cur[6] and tonumber(cur[6]) > tonumber(last) then last = cur[6] end
  redis.call('hset', sk, 'data', data, 'version', new_version, 'token', token, 'run', run, 'labels', labels,
    'created', created, 'retain', retain, 'last_active', last)
  index(p, id, created, token, run, labels, retain)
  return 1, last, false
end
