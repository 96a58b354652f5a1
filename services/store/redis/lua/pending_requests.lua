-- uses: requests_lib
-- ARGV: prefix, scope, limit. Returns up to `limit` PENDING records of the scope, flat: {request_id, state,
-- owner, result, created_at, finished_at, ...}. `pend:<scope>` holds the request_ids of its PENDING records:
-- a claim adds one, a completion or release removes it.
local p, scope = ARGV[1], ARGV[2]
local out = {}
for _, id in ipairs(redis.call('srandmember', p .. 'pend:' .. scope, tonumber(ARGV[3]))) do
  local r = request_fields(p, request_key(scope, id))
  if r and r[1] == 'pending' then
    for _, v in ipairs({id, r[1], r[2], r[3], r[4], r[5]}) do out[#out + 1] = v end
  end
end
return out
