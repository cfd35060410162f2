"""The Lua scripts behind every atomic change of a job (see ``ckptconv.core.jobstore`` for the layout).

Each script checks the job's current state and changes the hash, its index sets, its event stream
and the counters in one step, so there is no moment where they disagree. The comment above each
script names its KEYS and ARGV.
"""

from __future__ import annotations

from ckptconv.core.job_records import DURATION_BUCKETS, EVENTS_MAXLEN

_LUA_COMMON = """
local TERMINAL = {succeeded=true, failed=true, cancelled=true}
local BUCKETS = {__BUCKETS__}

local function finish_stats(p, job_key, to, now, nbytes)
  local stats = p .. 'stats'
  redis.call('HINCRBY', stats, 'finished:' .. to, 1)
  local started = redis.call('HGET', job_key, 'started_ms')
  if started then
    local d = (now - tonumber(started)) / 1000
    for _, le in ipairs(BUCKETS) do
      if d <= le then redis.call('HINCRBY', stats, 'duration_bucket:' .. le, 1) end
    end
    redis.call('HINCRBY', stats, 'duration_bucket:+Inf', 1)
    redis.call('HINCRBYFLOAT', stats, 'duration_sum', d)
    redis.call('HINCRBY', stats, 'duration_count', 1)
  end
  if nbytes > 0 then redis.call('HINCRBY', stats, 'bytes_converted', nbytes) end
end

-- Move job `id` from its current state to `to` if the current state is in `allowed`.
local function transition(p, job_key, events_key, id, allowed, to, now, retention, nbytes, fields)
  local meta = redis.call('HMGET', job_key, 'state', 'owner')
  local cur = meta[1]
  if not cur then return {'missing', ''} end
  if not allowed[cur] then return {'refused', cur} end
  if cur ~= to then
    local o = p .. 'jobs:o:' .. meta[2]
    redis.call('ZREM', o .. ':s:' .. cur, id)
    redis.call('ZADD', o .. ':s:' .. to, 0, id)
    redis.call('ZREM', p .. 'jobs:s:' .. cur, id)
    redis.call('ZADD', p .. 'jobs:s:' .. to, now, id)
  end
  redis.call('HSET', job_key, 'state', to, 'updated_ms', now)
  if #fields > 0 then redis.call('HSET', job_key, unpack(fields)) end
  local event = cjson.encode({state=to, previous=cur, at=now})
  redis.call('XADD', events_key, 'MAXLEN', '~', __MAXLEN__, '*', 'type', 'state', 'data', event)
  if TERMINAL[to] and not TERMINAL[cur] then
    finish_stats(p, job_key, to, now, nbytes)
    local claim = redis.call('HMGET', job_key, 'target_key', 'target_claim')
    if claim[1] and redis.call('GET', claim[1]) == id then redis.call('DEL', claim[1]) end
    if claim[2] then
      -- The claim's 4th, 6th, ... keys are the sets of jobs under each target holding this one.
      local i = 0
      for key in string.gmatch(claim[2], '%S+') do
        i = i + 1
        if i >= 4 and i % 2 == 0 then redis.call('SREM', key, id) end
      end
    end
    if retention > 0 then
      redis.call('PEXPIRE', job_key, retention)
      redis.call('PEXPIRE', events_key, retention)
      redis.call('ZREMRANGEBYSCORE', p .. 'jobs:s:' .. to, '-inf', now - retention)
    end
  end
  return {'ok', cur}
end

local function set_of(csv)
  local s = {}
  for name in string.gmatch(csv, '[^,]+') do s[name] = true end
  return s
end
""".replace("__BUCKETS__", ", ".join(str(b) for b in DURATION_BUCKETS)).replace("__MAXLEN__", str(EVENTS_MAXLEN))

# Fenced: with a non-empty `attempt`, the change is refused ('fenced') unless it is still the job's
# current attempt (a worker that lost the job to another attempt changes nothing).
# KEYS: job, events. ARGV: prefix, id, allowed (csv), to, now_ms, retention_ms, bytes, attempt (or ''),
#       field, value, ...
TRANSITION_LUA = (
    _LUA_COMMON
    + """
if ARGV[8] ~= '' and redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[8] then
  return {'fenced', redis.call('HGET', KEYS[1], 'state') or ''}
end
local fields = {}
for i = 9, #ARGV do fields[#fields + 1] = ARGV[i] end
return transition(ARGV[1], KEYS[1], KEYS[2], ARGV[2], set_of(ARGV[3]), ARGV[4], tonumber(ARGV[5]),
                  tonumber(ARGV[6]), tonumber(ARGV[7]), fields)
"""
)

# A worker starts an attempt: take the lease and count the attempt in one step, so that each
# attempt number has exactly one holder. Refused while another token holds a live lease. The same
# call sent again after its reply was lost (its token holds the lease and names the attempt's
# worker) answers the attempt it started, and does not count another.
# KEYS: lease, job, events. ARGV: prefix, id, token, lease_ms, now_ms, max_attempts
# Returns {'started', attempt, previous state} | {'held', holder} | {'terminal', state}
#       | {'exhausted', attempts} | {'missing', ''}
START_LUA = (
    _LUA_COMMON
    + """
local meta = redis.call('HMGET', KEYS[2], 'state', 'attempts', 'started_ms')
local state = meta[1]
if not state then return {'missing', ''} end
if TERMINAL[state] then return {'terminal', state} end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[3] then return {'held', holder} end
if holder and redis.call('HGET', KEYS[2], 'worker') == ARGV[3] then return {'started', meta[2], state} end
local attempts = tonumber(meta[2] or '0')
if attempts >= tonumber(ARGV[6]) then return {'exhausted', tostring(attempts)} end
local attempt = tostring(attempts + 1)
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
local fields = {'attempts', attempt, 'worker', ARGV[3], 'heartbeat_ms', ARGV[5]}
if not meta[3] then fields[#fields + 1] = 'started_ms'; fields[#fields + 1] = ARGV[5] end
local to = state == 'cancelling' and 'cancelling' or 'running'
transition(ARGV[1], KEYS[2], KEYS[3], ARGV[2], {queued=true, running=true, cancelling=true}, to,
           tonumber(ARGV[5]), 0, 0, fields)
return {'started', attempt, state}
"""
)

# The reaper gives a job whose owner is gone its message again (the one the API queued), if it is
# still in the same attempt, has no live lease and is not final.
# KEYS: job, lease, queue. ARGV: attempt, now_ms
REQUEUE_LUA = """
local meta = redis.call('HMGET', KEYS[1], 'state', 'attempts', 'message')
if not meta[1] or meta[1] == 'succeeded' or meta[1] == 'failed' or meta[1] == 'cancelled' then return 0 end
if (meta[2] or '0') ~= ARGV[1] or redis.call('EXISTS', KEYS[2]) == 1 or not meta[3] then return 0 end
redis.call('LPUSH', KEYS[3], meta[3])
redis.call('HSET', KEYS[1], 'requeued_ms', ARGV[2])
return 1
"""

# A job cancelled while queued keeps the token of the call that cancelled it: that call, sent again
# after its reply was lost, answers 'cancelled' again (its caller then sends the job's webhook, which
# 'unchanged' would skip).
# KEYS: job, events. ARGV: prefix, id, owner, now_ms, retention_ms, error_json, token
CANCEL_LUA = (
    _LUA_COMMON
    + """
local meta = redis.call('HMGET', KEYS[1], 'state', 'owner', 'cancel_token')
if not meta[1] or meta[2] ~= ARGV[3] then return {'missing', ''} end
if meta[3] == ARGV[7] then return {'cancelled', 'queued'} end
local now = tonumber(ARGV[4])
if meta[1] == 'queued' then
  transition(ARGV[1], KEYS[1], KEYS[2], ARGV[2], {queued=true}, 'cancelled', now, tonumber(ARGV[5]), 0,
             {'finished_ms', ARGV[4], 'error', ARGV[6], 'cancel_requested', '1', 'cancel_token', ARGV[7]})
  return {'cancelled', 'queued'}
elseif meta[1] == 'running' then
  transition(ARGV[1], KEYS[1], KEYS[2], ARGV[2], {running=true}, 'cancelling', now, 0, 0, {'cancel_requested', '1'})
  return {'cancelling', 'running'}
end
return {'unchanged', meta[1]}
"""
)

# Create a job, its index entries, its target reservation, its Idempotency-Key record and its queue
# message, atomically. The Idempotency-Key is looked up first (a repeated request gets the first
# answer even while its job holds the target); then the target: refused when a live job holds it,
# a target under it (its set of jobs under it) or a target over it (a directory holding it).
# KEYS: job, idempotency (or ''), queue, then the target's claim if it has one
#       (RedisKeys.target_claim: its reservation, its set of jobs under it, then (reservation, set)
#       of each target holding it, outermost first).
# ARGV: prefix, id, owner, kind, fingerprint, idem_ttl_ms, response_body, message, n, then n
#       arguments: the hash's fields (name, value, ...), then the labels (name, value, ...). One
#       argument per field rather than JSON: Redis decoding JSON cost more than the API's client
#       packing the arguments (hiredis packs them; see service.limits).
SUBMIT_LUA = """
local p, id, owner, kind = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if KEYS[2] ~= '' then
  local prev = redis.call('HMGET', KEYS[2], 'fp', 'status', 'code', 'body', 'location')
  if prev[1] then
    return {'exists', prev[1], prev[2] or '', prev[3] or '', prev[4] or '', prev[5] or ''}
  end
end
-- The job exists only if this same call ran before (each submission has an id of its own): its
-- reply was lost and the call was sent again. Its answer stands; it is not queued twice.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {'created'}
end
local function live(holder)
  local held = redis.call('HMGET', p .. 'job:' .. holder, 'state', 'owner')
  if held[1] and held[1] ~= 'succeeded' and held[1] ~= 'failed' and held[1] ~= 'cancelled' then
    return held[2]
  end
  return nil
end
if #KEYS >= 4 then
  for i = 4, #KEYS, 2 do  -- this target's reservation, then those of the targets holding it
    local holder = redis.call('GET', KEYS[i])
    if holder then
      local owner = live(holder)
      if owner then return {'target_taken', holder, owner} end
    end
  end
  -- The first live job under this target is found in the first page: a final job leaves the set
  -- when it ends (a stale member found is dropped). Paged rather than SMEMBERS: with thousands of
  -- live jobs under a directory, reading the whole set blocked Redis for each refused submission.
  local cursor = '0'
  repeat
    local page = redis.call('SSCAN', KEYS[5], cursor, 'COUNT', 16)
    cursor = page[1]
    for _, holder in ipairs(page[2]) do
      local owner = live(holder)
      if owner then return {'target_taken', holder, owner} end
      redis.call('SREM', KEYS[5], holder)
    end
  until cursor == '0'
  redis.call('SET', KEYS[4], id)
  for i = 7, #KEYS, 2 do redis.call('SADD', KEYS[i], id) end
end
if KEYS[2] ~= '' then
  redis.call('HSET', KEYS[2], 'fp', ARGV[5], 'status', 'done', 'code', '202', 'body', ARGV[7],
             'location', '/v1/jobs/' .. id)
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
end
local n = tonumber(ARGV[9])
-- The queued message is kept so that the reaper can queue it again if it is ever lost.
redis.call('HSET', KEYS[1], 'message', ARGV[8], unpack(ARGV, 10, 9 + n))
local o = p .. 'jobs:o:' .. owner
redis.call('ZADD', o, 0, id)
redis.call('ZADD', o .. ':s:queued', 0, id)
redis.call('ZADD', o .. ':k:' .. kind, 0, id)
for i = 10 + n, #ARGV, 2 do redis.call('ZADD', o .. ':l:' .. ARGV[i] .. '=' .. ARGV[i + 1], 0, id) end
redis.call('ZADD', p .. 'jobs:s:queued', redis.call('TIME')[1] * 1000, id)
redis.call('LPUSH', KEYS[3], ARGV[8])
return {'created'}
"""

# Idempotency for requests other than job creation: claim, then complete or release.
# Each request claims with a token of its own: a pending claim that holds the caller's token was made
# by this same call, sent again after its reply was lost (a lost shared connection resends every
# command written on it), and is answered 'claimed' again rather than "in flight" to its claimant.
# KEYS: idempotency. ARGV: fingerprint, pending_ttl_ms, token
IDEM_CLAIM_LUA = """
local prev = redis.call('HMGET', KEYS[1], 'fp', 'status', 'code', 'body', 'location', 'claim')
if prev[1] then
  if prev[2] == 'pending' and prev[6] == ARGV[3] then return {'claimed'} end
  return {'exists', prev[1], prev[2] or '', prev[3] or '', prev[4] or '', prev[5] or ''}
end
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'status', 'pending', 'claim', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'claimed'}
"""

# Release a pending claim (its request failed with a 5xx: a retry runs again), only if it is still
# the caller's own: a claim that lapsed and was taken by another request stays that request's.
# KEYS: idempotency. ARGV: token
IDEM_RELEASE_LUA = """
local claim = redis.call('HMGET', KEYS[1], 'status', 'claim')
if claim[1] == 'pending' and claim[2] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Record a request's answer (2xx, 4xx) over its pending claim, only if the claim is still the
# caller's own: a claim that lapsed and was taken by another request stays that request's (its own
# answer is recorded when it ends). Sent again after its reply was lost, it finds the answer done.
# KEYS: idempotency. ARGV: token, code, body, location, ttl_seconds
IDEM_COMPLETE_LUA = """
local claim = redis.call('HMGET', KEYS[1], 'status', 'claim')
if claim[1] ~= 'pending' or claim[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'done', 'code', ARGV[2], 'body', ARGV[3], 'location', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""

# Worker heartbeat: renew the lease if still ours, keep the broker from re-delivering the running
# task's message (kombu's unacked index is scored by delivery time), and read the cancel flag.
# A lease that lapsed (Redis slow or unreachable for longer than the lease) is taken again when
# nobody else holds it and the job is still in this attempt: the attempt number is the fence.
# KEYS: lease, job, unacked_index. ARGV: token, lease_ms, now_ms, delivery_tag, now_s, attempt
HEARTBEAT_LUA = """
local holder = redis.call('GET', KEYS[1])
local mine = holder == ARGV[1]
if not holder and redis.call('HGET', KEYS[2], 'attempts') == ARGV[6] then
  local state = redis.call('HGET', KEYS[2], 'state')
  if state == 'running' or state == 'cancelling' then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    mine = true
  end
end
if mine then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('HSET', KEYS[2], 'heartbeat_ms', ARGV[3])
  if ARGV[4] ~= '' then redis.call('ZADD', KEYS[3], 'XX', ARGV[5], ARGV[4]) end
end
local cancel = redis.call('HGET', KEYS[2], 'cancel_requested') or ''
return {mine and 1 or 0, cancel}
"""

# Progress of the current attempt only. KEYS: job, events. ARGV: attempt, data, now_ms, maxlen
PROGRESS_LUA = """
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'progress', ARGV[2], 'updated_ms', ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'type', 'progress', 'data', ARGV[2])
return 1
"""

# KEYS: lease. ARGV: token
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
