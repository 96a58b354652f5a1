-- uses: sessions_lib update_lib log_lib requests_lib
-- ARGV: prefix, then three parts, each a flag ('1' or '') and its arguments (empty strings when absent):
--   [2] session? ('1': updated, 'c': created)  [3..12] the update's 10 arguments (see update; a create's
--       expected version is '' and its new version '1')
--   [13] request? [14..18] key, scope, request_id, result, now
--   [19] call?    [20..24] session id, episode, request_id, entry JSON, finished_at (the touch)
--   [25] new request? [26] nonce of this call ('' unless new)
--   [27] held_by ('' for none)
-- Returns {code, last_active} of the update or create ({1, ''} without a session), or {-3, state, owner, result,
-- created_at, finished_at} when a new request's record exists already or another owner's record is not
-- ours to complete (held_by; DONE with this result is our own retried commit). Nothing is written unless the
-- request check and the update succeed; a retry of a commit that already ran returns at once (the rest
-- ran with it): for a new request, the record carrying this call's nonce says so.
local p = ARGV[1]
local code, last = 1, ''
if ARGV[25] == '1' then
  local r = request_fields(p, ARGV[14])
  if r and r[6] ~= ARGV[26] then return {-3, r[1], r[2], r[3], r[4], r[5]} end
  if r then  -- our own retried commit
    if ARGV[2] == '1' then return {1, redis.call('hget', p .. 's:' .. ARGV[3], 'last_active') or ARGV[12]} end
    return {1, ''}
  end
end
if ARGV[27] ~= '' then  -- held_by: completed only while missing, PENDING under it, or DONE with this result
  local r = request_fields(p, ARGV[14])
  if r and not ((r[1] == 'pending' and r[2] == ARGV[27]) or (r[1] ~= 'pending' and r[3] == ARGV[17])) then
    return {-3, r[1], r[2], r[3], r[4], r[5]}
  end
end
if ARGV[2] == 'c' then
  code = create(p, ARGV[3], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[12])
  if code ~= 1 then return {code, ''} end
  last = ARGV[12]
elseif ARGV[2] == '1' then
  local retried
  code, last, retried = update(p, ARGV, 3)
  if code ~= 1 or retried then return {code, last} end
end
if ARGV[13] == '1' then complete(p, ARGV[14], ARGV[15], ARGV[16], ARGV[17], ARGV[18], ARGV[26]) end
if ARGV[19] == '1' then
  append(p, ARGV[20], ARGV[21], ARGV[22], ARGV[23])
  touch(p, ARGV[20], ARGV[24])
end
return {code, last}
