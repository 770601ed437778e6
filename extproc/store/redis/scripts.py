"""Lua scripts of the Redis store: every decision and every mutation happens inside one script call.

Why Lua: a request names several keys and each key several shares; checking them and taking capacity must be
one atomic step across all of them, or two replicas interleaving their reads and writes over-admit. Redis
runs a script to completion before serving anything else, so a script is the transaction.

Time comes from `redis.call('TIME')`, never from the caller: replicas with skewed clocks then agree on how
much a bucket has refilled and on when a lease expires.

Key layout (`P` is KEYS[1], the prefix with its hash tag, e.g. `extproc:{limits}:`; `#k` is the byte length
of the limiter key `k`, which keeps `k` and the share name apart whatever characters they hold):

- `P l:#k:k:share` (zset): open leases on one share, scored by their expiry (server time, seconds);
  expires lease TTL + 10 s after the last add or renewal.
- `P u` (zset): leases whose slots were given back before their settlement (`RELEASE_SLOT`: the engine
  finished while the client still reads), their tokens still reserved, scored by their expiry as in `l`;
  renewed as they are, and gone with their release. Leases of every key, in one set: a lease is named by
  its member alone, unique across replicas.
- `P s:#k:k` (set): share names that may hold leases, so leases of a guarantee this replica no longer
  knows are still counted; same expiry.
- `P b:#k:k:share` (hash): the bucket: `t` tokens (negative: debt), `ts` last update, `c` the capacity it
  refills at; expires when it would be full again + 60 s (1 h for a share cut to nothing).
- `P k:#k:k` (hash): `hold`, the moving average of lease durations for slot retry hints; 1 h after the
  last release.
- `P c:#k:k` (hash): the shared adaptive scale: `e` the effective scale every replica must use, and one
  field `r:<replica>` per replica, `<scale> <expiry>`, its proposal from its own KV feed. `e` is the minimum
  of the fresh proposals (1 when none), recomputed only by the SCALE script; the hash expires a proposal TTL
  after the last proposal, and then the scale is 1 again.
- `P kv:#p:p` (hash): the KV-budget figures of pool `p` (`extproc.core.kv.fleet`), one field `r:<replica>`
  per replica, `<expiry ms> <booked> <held> <settled> <candidates> <yielding> <heard ms> <horizons' id>
  <frees...>`; a field past its expiry is dropped by the next KV_POOL call, the hash itself a TTL after the
  last one.
- `P wq` (string): present while some replica has requests waiting in its queue; a release then publishes
  on the channel `P wake` so that the other replicas try their waiters at once.
- `P epoch` (hash): `id`, the run id of the state these keys hold, and `rec`, the server time until which
  admissions wait for the replicas to re-assert their leases after a loss was found. Refreshed by every
  acquire and guard check (1 day TTL), so it is gone only when Redis lost its data (a flush, a restart
  without persistence, eviction): a replica that knew another id then knows its leases are no longer
  counted (`guard.py`).

A missing bucket is a full one: an expired bucket had refilled to capacity anyway.

Arguments describing keys (`KEYSPEC` below) are, after a count of keys, for each key: the key, the adaptive
scale the caller computed the capacities at, `1` if it has a tokens-per-minute limit, the number of
configured shares, then per share: name, effective slots (`''`: unlimited), effective token capacity (`''`:
no bucket; `0`: cut to nothing), and capacity at scale 1 (for "too large, never retry"). The caller
computes these from its config with `effective_shares`; shares found in Redis but not configured here (a
removed guarantee with open leases) get zero slots and zero tokens, exactly like `JointLimiter`.

Every script that takes a KEYSPEC first compares each key's scale with the stored effective scale and, if
any differs, changes nothing and replies `stale` followed by the effective scale of every key: the caller
recomputes its capacities and calls again. So no decision is ever taken at a scale other than the one
stored, whichever replica takes it.

Numbers that may be fractional are returned as strings (Lua numbers become integers in Redis replies).
"""

from __future__ import annotations

COMMON = r"""
local SHARED = '_shared'
local EPS = 1e-6
local INF = math.huge
local P = KEYS[1]

local function fmt(x) return string.format('%.17g', x) end

local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function rkey(kind, key, share)
  local n = P .. kind .. ':' .. string.len(key) .. ':' .. key
  if share then n = n .. ':' .. share end
  return n
end

local function opt(s) if s == '' then return nil end return tonumber(s) end

local function parse_keys(i)
  local keys = {}
  local n = tonumber(ARGV[i]); i = i + 1
  for k = 1, n do
    local spec = {key = ARGV[i], scale = tonumber(ARGV[i + 1]), has_tpm = ARGV[i + 2] == '1', shares = {},
                  order = {}}
    local ns = tonumber(ARGV[i + 3]); i = i + 4
    for _ = 1, ns do
      spec.shares[ARGV[i]] = {conc = opt(ARGV[i + 1]), cap = opt(ARGV[i + 2]), base = tonumber(ARGV[i + 3])}
      table.insert(spec.order, ARGV[i])
      i = i + 4
    end
    keys[k] = spec
  end
  return keys, i
end

local function effective_scale(key)
  local e = redis.call('HGET', rkey('c', key), 'e')
  if e then return tonumber(e) end
  return 1
end

-- nil when every key's capacities were computed at the stored scale; else the `stale` reply.
local function stale(keys)
  local out, bad = {'stale'}, false
  for i, k in ipairs(keys) do
    local e = effective_scale(k.key)
    if math.abs(e - k.scale) > 1e-12 then bad = true end
    out[i + 1] = fmt(e)
  end
  if bad then return out end
  return nil
end

-- Tokens of a stored bucket refilled to `now` at the capacity it was last written with, or nil if absent.
local function load_bucket(key, share, now)
  local b = redis.call('HMGET', rkey('b', key, share), 't', 'ts', 'c')
  if not b[1] then return nil end
  local t, ts, c = tonumber(b[1]), tonumber(b[2]), tonumber(b[3])
  if now > ts and c > 0 then t = math.min(c, t + (now - ts) * c / 60) end
  return t
end

local function save_bucket(key, share, t, now, cap)
  local bk = rkey('b', key, share)
  local c = math.max(cap, 0)
  redis.call('HSET', bk, 't', fmt(t), 'ts', fmt(now), 'c', fmt(c))
  local ttl = 3600
  if c > 0 then ttl = math.ceil((c - t) / (c / 60)) + 60 end
  redis.call('PEXPIRE', bk, math.max(1, ttl) * 1000)
end

-- Active leases and bucket levels of every share of one key, expired leases dropped first.
local function gather(k, now)
  local setk = rkey('s', k.key)
  local inset = {}
  for _, s in ipairs(redis.call('SMEMBERS', setk)) do
    inset[s] = true
    if not k.shares[s] then
      k.shares[s] = {conc = 0, cap = 0, base = 0, removed = true}
      table.insert(k.order, s)
    end
  end
  local live = {}
  for _, s in ipairs(k.order) do
    local sh = k.shares[s]
    local lk = rkey('l', k.key, s)
    redis.call('ZREMRANGEBYSCORE', lk, '-inf', now)
    sh.active = redis.call('ZCARD', lk)
    if sh.active == 0 and inset[s] then redis.call('SREM', setk, s) end
    if sh.removed and sh.active == 0 then
      k.shares[s] = nil
    else
      if sh.cap ~= nil then
        local t = load_bucket(k.key, s, now)
        if t == nil then
          if sh.cap > 0 then sh.tokens = sh.cap end
        elseif sh.cap > 0 then
          sh.tokens = math.min(t, sh.cap)
        else
          sh.tokens = math.min(t, 0)
        end
      end
      table.insert(live, s)
    end
  end
  k.order = live
  k.hold = redis.call('HGET', rkey('k', k.key), 'hold')
end

local function candidates(k, holder, use_pool)
  if holder ~= '' and holder ~= SHARED and k.shares[holder] then
    if use_pool then return {holder, SHARED} end
    return {holder}
  end
  return {SHARED}
end

local function free_slots(k, name)
  local sh = k.shares[name]
  if sh.conc == nil then return INF end
  local free = sh.conc - sh.active
  if name == SHARED then
    for _, s in ipairs(k.order) do
      local o = k.shares[s]
      if s ~= SHARED and o.conc ~= nil then free = free - math.max(0, o.active - o.conc) end
    end
  end
  return free
end

-- The run id of the stored state, created when missing; `known` is the id the caller last saw ('' none).
-- A caller that knew another id proves the state was lost: admissions then wait `rec_ms` (from now) for
-- every replica to re-assert its leases. Returns the id and the recovery time left (s, <= 0: none).
local function epoch(known, new_id, rec_ms, now)
  local ek = P .. 'epoch'
  local cur = redis.call('HMGET', ek, 'id', 'rec')
  local id, rec = cur[1], tonumber(cur[2] or '0')
  if not id then
    id, rec = new_id, 0
    redis.call('HSET', ek, 'id', id, 'rec', '0')
  end
  if known ~= '' and known ~= id then
    rec = math.max(rec, now + rec_ms / 1000)
    redis.call('HSET', ek, 'rec', fmt(rec))
  end
  redis.call('PEXPIRE', ek, 86400000)
  return id, rec - now
end

-- One lease's hold time (s) into the key's moving average, read for slot retry hints.
local function hold(key, held)
  local hk = rkey('k', key)
  local h = redis.call('HGET', hk, 'hold')
  if h then h = 0.8 * tonumber(h) + 0.2 * held else h = held end
  redis.call('HSET', hk, 'hold', fmt(h))
  redis.call('PEXPIRE', hk, 3600000)
end

local function append_state(out, k)
  out[#out + 1] = k.hold or ''
  out[#out + 1] = #k.order
  for _, s in ipairs(k.order) do
    local sh = k.shares[s]
    out[#out + 1] = s
    out[#out + 1] = sh.active
    out[#out + 1] = sh.tokens and fmt(sh.tokens) or ''
  end
end
"""

ACQUIRE = (
    COMMON
    + r"""
-- ARGV: member, lease ttl s, lease key ttl ms, tokens, holder ('' none), use_pool ('1'/'0'; 'a': an
--       adoption, placed in the first candidate share whatever its free slots and tokens, its bucket going
--       below zero where it must: a request already running, admitted while this store could not answer),
--       wait hint when only the pool could ever hold the tokens, the epoch id the caller knows ('' none),
--       the recovery time after a loss (ms), KEYSPEC, then per key: the tokens its bucket must hold (its
--       part of `tokens`: extproc/core/limiter/split.py `key_tokens`)
-- Reply: `epoch` with the stored id and the recovery time left when the caller knows another id;
--        `recovering` with the time left while replicas re-assert their leases after a loss; `stale`;
--        or code (0 admitted, 1 concurrency, 2 tokens, 3 too large), refusing key index, server now,
--        then per key: slot share, token share ('' none), hold, share count, (name, active, tokens)...
local member, ttl, key_ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local holder, use_pool = ARGV[5], ARGV[6] ~= '0'  -- ARGV[4]: the whole reservation, each key's part below
local adopt = ARGV[6] == 'a'
local fallback_wait = tonumber(ARGV[7])
local keys, at = parse_keys(10)
for _, k in ipairs(keys) do k.need = tonumber(ARGV[at]); at = at + 1 end
local now = clock()
local ep, left = epoch(ARGV[8], member, tonumber(ARGV[9]), now)
if ep ~= ARGV[8] then return {'epoch', ep, fmt(left)} end
if left > 0 then return {'recovering', fmt(left)} end
local refused = stale(keys)
if refused then return refused end
for _, k in ipairs(keys) do gather(k, now) end

local function reply(code, idx, slots, toks)
  local out = {code, idx, fmt(now)}
  for i, k in ipairs(keys) do
    out[#out + 1] = slots and slots[i] or ''
    out[#out + 1] = toks and toks[i] or ''
    append_state(out, k)
  end
  return out
end

local function place_tokens(k)
  if not k.has_tpm then return nil, 0 end
  local tokens = k.need
  if adopt then
    for _, s in ipairs(candidates(k, holder, true)) do
      local sh = k.shares[s]
      if sh.tokens ~= nil and sh.cap ~= nil then return s, 0 end
    end
    return nil, 0
  end
  local fits = false
  for _, s in ipairs(candidates(k, holder, true)) do
    if tokens <= k.shares[s].base then fits = true end
  end
  if not fits then return nil, INF end
  local best = nil
  for _, s in ipairs(candidates(k, holder, use_pool)) do
    local sh = k.shares[s]
    if sh.tokens ~= nil and sh.cap ~= nil and sh.cap > 0 then
      local wait
      if tokens > sh.cap then
        wait = INF
      elseif tokens - sh.tokens <= EPS then
        return s, 0
      else
        wait = (tokens - sh.tokens) / (sh.cap / 60)
      end
      if wait ~= INF and (best == nil or wait < best) then best = wait end
    end
  end
  if best ~= nil then return nil, best end
  return nil, fallback_wait  -- only the pool could hold it: shrunk by pressure, or withheld for now
end

local slots = {}
for i, k in ipairs(keys) do
  for _, s in ipairs(candidates(k, holder, use_pool)) do
    if free_slots(k, s) >= 1 then slots[i] = s; break end
  end
  if adopt and not slots[i] then slots[i] = candidates(k, holder, true)[1] end
  if not slots[i] then return reply(1, i) end
end

local toks, worst, worst_i = {}, nil, 0
for i, k in ipairs(keys) do
  local s, wait = place_tokens(k)
  if wait == INF then return reply(3, i) end
  if wait > 0 and (worst == nil or wait > worst) then worst, worst_i = wait, i end
  toks[i] = s or ''
end
if worst ~= nil then return reply(2, worst_i) end

local expiry = now + ttl
for i, k in ipairs(keys) do
  local lk, setk = rkey('l', k.key, slots[i]), rkey('s', k.key)
  redis.call('ZADD', lk, expiry, member)
  redis.call('PEXPIRE', lk, key_ttl_ms)
  redis.call('SADD', setk, slots[i])
  redis.call('PEXPIRE', setk, key_ttl_ms)
  local sh = k.shares[slots[i]]
  sh.active = sh.active + 1
  if toks[i] ~= '' then
    local tsh = k.shares[toks[i]]
    tsh.tokens = tsh.tokens - k.need
    save_bucket(k.key, toks[i], tsh.tokens, now, tsh.cap)
  end
end
return reply(0, 0, slots, toks)
"""
)

RELEASE = (
    COMMON
    + r"""
-- ARGV: member, acquired_at (server time), KEYSPEC, then per key: slot share, token share, the tokens its
--       bucket holds for the lease and the tokens to charge it (each key its part: split.py `key_tokens`)
-- Reply: 1 if this call settled the lease (0: settled before, or expired), server now, per key: state.
-- A lease is alive while its score is in the future; all its members share one score, so checking the first
-- decides for all. Settling an expired lease would refund tokens already written off: it is a no-op instead.
-- A lease whose slots were given back (`P u`) is alive by its score there: its tokens settle, no slot is
-- freed twice, and the hold time was counted when the slots came back.
local member, acquired = ARGV[1], tonumber(ARGV[2])
local keys, i = parse_keys(3)
local refused = stale(keys)
if refused then return refused end
local now = clock()
local places = {}
for k = 1, #keys do
  places[k] = {slot = ARGV[i], tok = ARGV[i + 1], reserved = tonumber(ARGV[i + 2]),
               actual = tonumber(ARGV[i + 3])}
  i = i + 4
end
local alive, holding = false, false
if #keys > 0 then
  local score = redis.call('ZSCORE', rkey('l', keys[1].key, places[1].slot), member)
  holding = score and tonumber(score) > now
  local freed = redis.call('ZSCORE', P .. 'u', member)
  alive = holding or (freed and tonumber(freed) > now)
end
for k, spec in ipairs(keys) do redis.call('ZREM', rkey('l', spec.key, places[k].slot), member) end
redis.call('ZREM', P .. 'u', member)

local function settle(spec, share, reserved, actual)
  local sh = spec.shares[share]
  local cap = 0
  if sh then cap = sh.cap end
  if cap == nil then return end  -- no token limit: nothing to correct
  local t = load_bucket(spec.key, share, now)
  local room = math.max(cap, 0)
  if t == nil then
    if cap <= 0 then return end
    t = cap
  end
  t = math.min(t, room)
  local delta = reserved - actual
  if delta > 0 then
    t = t + math.max(0, math.min(delta, room - t))  -- a refund never lifts a bucket above capacity
  else
    t = t + delta  -- an overrun is debt, paid off by refill
  end
  save_bucket(spec.key, share, t, now, cap)
end

if alive then
  local held = math.max(0, now - acquired)
  for k, spec in ipairs(keys) do
    local pl = places[k]
    if pl.tok ~= '' then settle(spec, pl.tok, pl.reserved, pl.actual) end
    if holding then hold(spec.key, held) end
  end
  if redis.call('EXISTS', P .. 'wq') == 1 then redis.call('PUBLISH', P .. 'wake', 'release') end
end
local out = {alive and 1 or 0, fmt(now)}
for _, spec in ipairs(keys) do
  gather(spec, now)
  append_state(out, spec)
end
return out
"""
)

RELEASE_SLOT = (
    COMMON
    + r"""
-- ARGV: member, acquired_at (server time), lease key ttl ms, KEYSPEC, then per key: slot share.
-- Reply: 1 if this call gave the lease's slots back (0: given back before, settled, or expired), server now,
--        per key: state.
-- The lease leaves every slot it holds and waits in `P u`, at the expiry it had, for its release to settle
-- its tokens; the slots' hold time is counted now, as a release counts it.
local member, acquired, key_ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local keys, i = parse_keys(4)
local refused = stale(keys)
if refused then return refused end
local now = clock()
local slots = {}
for k = 1, #keys do slots[k] = ARGV[i]; i = i + 1 end
local score = nil
if #keys > 0 then score = redis.call('ZSCORE', rkey('l', keys[1].key, slots[1]), member) end
local moved = score and tonumber(score) > now
if moved then
  for k, spec in ipairs(keys) do
    redis.call('ZREM', rkey('l', spec.key, slots[k]), member)
    hold(spec.key, math.max(0, now - acquired))
  end
  redis.call('ZADD', P .. 'u', score, member)
  redis.call('PEXPIRE', P .. 'u', key_ttl_ms)
  if redis.call('EXISTS', P .. 'wq') == 1 then redis.call('PUBLISH', P .. 'wake', 'release') end
end
local out = {moved and 1 or 0, fmt(now)}
for _, spec in ipairs(keys) do
  gather(spec, now)
  append_state(out, spec)
end
return out
"""
)

REFUND = (
    COMMON
    + r"""
-- ARGV: member, KEYSPEC, then per key: slot share, token share, the tokens its bucket gets back.
-- Reply: 1 if the lease is alive and its buckets got their tokens back (never above capacity), else 0, then
-- server now. The caller lowers its lease's reservation on 1, so the release stays exact.
local member = ARGV[1]
local keys, i = parse_keys(2)
local refused = stale(keys)
if refused then return refused end
local now = clock()
local places = {}
for k = 1, #keys do
  places[k] = {slot = ARGV[i], tok = ARGV[i + 1], tokens = tonumber(ARGV[i + 2])}
  i = i + 3
end
if #keys == 0 then return {0, fmt(now)} end
local score = redis.call('ZSCORE', rkey('l', keys[1].key, places[1].slot), member)
if not (score and tonumber(score) > now) then return {0, fmt(now)} end
for k, spec in ipairs(keys) do
  local share = places[k].tok
  local sh = spec.shares[share]
  if share ~= '' and sh and sh.cap ~= nil and sh.cap > 0 then
    local t = load_bucket(spec.key, share, now)
    if t ~= nil then  -- a missing bucket is full: nothing to give back
      save_bucket(spec.key, share, math.min(t + places[k].tokens, sh.cap), now, sh.cap)
    end
  end
end
if redis.call('EXISTS', P .. 'wq') == 1 then redis.call('PUBLISH', P .. 'wake', 'refund') end
return {1, fmt(now)}
"""
)

PEEK = (
    COMMON
    + r"""
-- ARGV: mode, KEYSPEC. Reply: server now, per key: state.
-- mode '0': read only (status, metrics cache).
-- mode 'fill': store every bucket at the capacities given, also those that exist only implicitly (full).
--   Sent with the old capacities just before a limit or scale change, so that the change starts from the
--   level the bucket really had, as the in-process limiter does, rather than from a full bucket at the new
--   capacity.
-- mode 'resize': store existing buckets at the (new) capacities given; drop buckets of shares that lost their
--   token limit, so a limit set later starts from a full bucket.
local mode = ARGV[1]
local keys = parse_keys(2)
local refused = stale(keys)
if refused then return refused end
local now = clock()
local out = {fmt(now)}
for _, spec in ipairs(keys) do
  gather(spec, now)
  for _, s in ipairs(spec.order) do
    local sh = spec.shares[s]
    local bk = rkey('b', spec.key, s)
    if mode == 'fill' and sh.tokens ~= nil then
      save_bucket(spec.key, s, sh.tokens, now, sh.cap)
    elseif mode == 'resize' then
      if sh.cap == nil then
        redis.call('DEL', bk)
      elseif sh.tokens ~= nil and redis.call('EXISTS', bk) == 1 then
        save_bucket(spec.key, s, sh.tokens, now, sh.cap)
      end
    end
  end
  append_state(out, spec)
end
return out
"""
)

RENEW = (
    COMMON
    + r"""
-- ARGV: lease ttl s, lease key ttl ms, lease count, then per lease: member, restore ('1': the caller knows
--       it is alive, so re-add it where it is missing), freed ('1': its slots were given back, so it is
--       kept in `P u`, never in a slot), n, (key, slot share) x n
-- Reply: {1-based indices of leases found expired (removed, never revived)},
--        {indices of leases that were missing and are re-added: Redis lost them before their expiry}.
-- A lease found in `P u` is renewed there whatever the caller says: the reply of the call that gave its
-- slots back may not have reached it, and re-adding it to a slot would take the slot again.
local ttl, key_ttl_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local n, i = tonumber(ARGV[3]), 4
local now = clock()
local expiry = now + ttl
local lost, restored = {}, {}
for li = 1, n do
  local member, restore, m = ARGV[i], ARGV[i + 1] == '1', tonumber(ARGV[i + 3])
  local uscore = redis.call('ZSCORE', P .. 'u', member)
  local freed = ARGV[i + 2] == '1' or uscore ~= false
  i = i + 4
  local alive, missing, expired = m == 0 and not freed, false, false
  if freed then
    if not uscore then
      missing = true
    elseif tonumber(uscore) > now then
      alive = true
    else
      expired = true
    end
  end
  for j = 0, freed and -1 or m - 1 do
    local score = redis.call('ZSCORE', rkey('l', ARGV[i + 2 * j], ARGV[i + 2 * j + 1]), member)
    if not score then
      missing = true
    elseif tonumber(score) > now then
      alive = true
    else
      expired = true
    end
  end
  local keep = not expired and (alive or restore)
  for _ = 1, m do
    local lk, setk = rkey('l', ARGV[i], ARGV[i + 1]), rkey('s', ARGV[i])
    if keep and not freed then
      redis.call('ZADD', lk, expiry, member)
      redis.call('PEXPIRE', lk, key_ttl_ms)
      redis.call('SADD', setk, ARGV[i + 1])
      redis.call('PEXPIRE', setk, key_ttl_ms)
    else
      redis.call('ZREM', lk, member)
    end
    i = i + 2
  end
  if freed and keep then
    redis.call('ZADD', P .. 'u', expiry, member)
    redis.call('PEXPIRE', P .. 'u', key_ttl_ms)
  elseif freed then
    redis.call('ZREM', P .. 'u', member)
  end
  if not keep then
    lost[#lost + 1] = li
  elseif missing then
    restored[#restored + 1] = li
  end
end
return {lost, restored}
"""
)

FORGET = (
    COMMON
    + r"""
-- ARGV: member, then (key, share) pairs. Removes a lease whose acquire timed out on the caller's side, from
-- every share it could have been placed on, and from `P u` (a lease re-added there by a renewal that crossed
-- its release). Tokens it may have taken stay charged (the safe side).
local member = ARGV[1]
local removed = redis.call('ZREM', P .. 'u', member)
for j = 2, #ARGV, 2 do
  removed = removed + redis.call('ZREM', rkey('l', ARGV[j], ARGV[j + 1]), member)
end
return removed
"""
)

SCALE = (
    COMMON
    + r"""
-- ARGV: replica, proposed scale ('1': withdraw), proposal ttl ms, KEYSPEC of one key at the effective scale
--       the caller believes in force.
-- Reply: `stale` (see above), or the effective scale in force before and after this proposal.
-- The effective scale is the minimum of the fresh proposals: a replica whose feed shows pressure lowers the
-- limits of all, a dead replica's proposal ages out. When it changes, the key's buckets are first stored at
-- the old capacities (as PEEK 'fill'), so that the caller's resize starts from the level they really had.
local field, proposed, ttl_ms = 'r:' .. ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local keys = parse_keys(4)
local refused = stale(keys)
if refused then return refused end
local k = keys[1]
local ck = rkey('c', k.key)
local now = clock()
local before = effective_scale(k.key)
if proposed < 1 then
  redis.call('HSET', ck, field, fmt(proposed) .. ' ' .. fmt(now + ttl_ms / 1000))
else
  redis.call('HDEL', ck, field)
end
local after = 1
local entries = redis.call('HGETALL', ck)
for j = 1, #entries, 2 do
  local name, value = entries[j], entries[j + 1]
  if string.sub(name, 1, 2) == 'r:' then
    local sep = string.find(value, ' ', 1, true)
    local scale, expiry = tonumber(string.sub(value, 1, sep - 1)), tonumber(string.sub(value, sep + 1))
    if expiry <= now then
      redis.call('HDEL', ck, name)
    elseif scale < after then
      after = scale
    end
  end
end
if after ~= before then
  gather(k, now)
  for _, s in ipairs(k.order) do
    local sh = k.shares[s]
    if sh.tokens ~= nil then save_bucket(k.key, s, sh.tokens, now, sh.cap) end
  end
  if after > before and redis.call('EXISTS', P .. 'wq') == 1 then
    redis.call('PUBLISH', P .. 'wake', 'scale')
  end
end
if after < 1 then
  redis.call('HSET', ck, 'e', fmt(after))
  redis.call('PEXPIRE', ck, ttl_ms)
else
  redis.call('HDEL', ck, 'e')
end
return {fmt(before), fmt(after)}
"""
)

WAITING = r"""
-- KEYS[1]: the prefix. ARGV: how long (ms) this replica's waiters should be announced.
-- Marks that requests wait somewhere, so that releases publish wake-ups; refreshed while anyone waits.
redis.call('SET', KEYS[1] .. 'wq', '1', 'PX', tonumber(ARGV[1]))
return 1
"""

GUARD = (
    COMMON
    + r"""
-- ARGV: the epoch id the caller knows ('' none), an id to create the epoch with, the recovery time (ms).
-- Reply: the stored epoch id and the recovery time left (s). See `epoch` above.
local id, left = epoch(ARGV[1], ARGV[2], tonumber(ARGV[3]), clock())
return {id, fmt(left)}
"""
)

REPLICA_FIGURES = r"""
-- A pool's figures of every replica in one hash, `P <kind>:#p:p`: one field `r:<replica>` per replica, its
-- expiry (ms of server time) first, then its figures; the key expires with the newest. `exchange` stores
-- this replica's (`figures`, its expiry prepended) and returns the others' still good, each {name, numbers},
-- dropping those past their expiry (a replica that died or lost the store) or malformed (under `width`).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function exchange(key, replica, ttl, now, figures, width)
  local own = 'r:' .. replica
  table.insert(figures, 1, now + ttl)
  redis.call('HSET', key, own, table.concat(figures, ' '))
  redis.call('PEXPIRE', key, ttl)
  local others = {}
  local entries = redis.call('HGETALL', key)
  for j = 1, #entries, 2 do
    local name = entries[j]
    if name ~= own then
      local v = {}
      for word in string.gmatch(entries[j + 1], '%S+') do v[#v + 1] = tonumber(word) end
      if #v < width or v[1] <= now then
        redis.call('HDEL', key, name)
      else
        others[#others + 1] = {name, v}
      end
    end
  end
  return others
end
"""

KV_POOL = (
    REPLICA_FIGURES
    + r"""
-- KEYS[1]: the prefix. ARGV: pool, replica, ttl ms, then the replica's figures of the pool: booked, held,
-- settled, candidates, yielding, heard (integers; heard: the server's time of the last answer the replica
-- had taken in), then the count n of horizons, their id (a checksum), the n horizons (ms after
-- publication, ascending) and the n tokens its leases will have freed by each (`ReplicaShare.frees`,
-- cumulative), then its head (the stamp of its oldest request waiting for the pool's KV, 0: none;
-- `FleetOrder`). Stores them as this replica's, good for ttl ms of server time, and replies the number of
-- other replicas whose figures are still good, the sums of their first five figures (`P kv` above), the
-- server's time and the least `heard` of those that do not yield (-1 with none), in ms, then the others'
-- frees summed by the same horizons counted from now: each replica's carried forward by the time since it
-- published (its expiry less ttl), a free already due counted by the first; last, the first stamp of this
-- replica's that does not come before every other head (the least other head, plus one where this replica's
-- field name is the lesser: a tie goes to it), 0 where no other has a head, or -1 where some other's field
-- has no head (a version before the order, or other horizons): such a replica divides the room as before,
-- so no replica takes it ahead of the others; then the least `heard` of all the others, yielding or not
-- (-1 with none): a run ahead is confirmed only once every other has read it. A field written before
-- `yielding` existed (four figures) sums as not yielding and is left out of the least `heard`: such a
-- replica never counts on a yielded part; one written before `frees`, or with other horizons (another id),
-- frees nothing.
local key = KEYS[1] .. 'kv:' .. string.len(ARGV[1]) .. ':' .. ARGV[1]
local now = now_ms()
local ttl = tonumber(ARGV[3])
local n = tonumber(ARGV[10])
local id = tonumber(ARGV[11])
local horizons = {}
local figures = {ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[11]}
for i = 1, n do
  horizons[i] = tonumber(ARGV[11 + i])
  figures[7 + i] = ARGV[11 + n + i]
end
figures[8 + n] = tonumber(ARGV[12 + 2 * n]) or 0
local own = 'r:' .. ARGV[2]
local bound = 0
local others = exchange(key, ARGV[2], ttl, now, figures, 5)
local sums = {0, 0, 0, 0, 0}
local frees = {}
for i = 1, n do frees[i] = 0 end
local oldest = -1
local oldest_all = -1
for _, other in ipairs(others) do
  local v = other[2]
  for i = 1, 5 do sums[i] = sums[i] + (v[i + 1] or 0) end
  if v[7] ~= nil and (oldest_all < 0 or v[7] < oldest_all) then oldest_all = v[7] end
  if (v[6] or 0) == 0 and v[7] ~= nil and (oldest < 0 or v[7] < oldest) then
    oldest = v[7]
  end
  local theirs = v[8] == id and #v == 9 + n and v[9 + n] or nil
  if theirs == nil then
    bound = -1
  elseif bound >= 0 and theirs > 0 then
    local first = theirs
    if own < other[1] then first = theirs + 1 end
    if bound == 0 or first < bound then bound = first end
  end
  local age = now - (v[1] - ttl)
  local before = 0
  local j = 1
  for i = 1, (v[8] == id and n or 0) do
    local freed = v[8 + i] or before
    while j < n and horizons[j] < horizons[i] - age do j = j + 1 end
    if freed > before then frees[j] = frees[j] + freed - before end
    before = math.max(before, freed)
  end
end
local reply = {#others, sums[1], sums[2], sums[3], sums[4], sums[5], now, oldest}
local total = 0
for i = 1, n do
  total = total + frees[i]
  reply[8 + i] = total
end
reply[9 + n] = bound
reply[10 + n] = oldest_all
return reply
"""
)

RUNS_POOL = (
    REPLICA_FIGURES
    + r"""
-- KEYS[1]: the prefix. ARGV: pool, replica, ttl ms, then the replica's runs of the pool: sequence-seconds
-- (a counter), sequences running, shown and left, and seconds idle (`RunFigures`). `P runs:#p:p` (hash): one
-- field `r:<replica>` per replica, `<expiry ms> <published ms> <seconds> <running> <shown> <left> <idle>`,
-- expiring as the KV_POOL figures do. Replies, for each other replica whose figures are still good: its
-- field name, its seconds carried to now at its running sequences, its running, shown and left sequences,
-- and its idle seconds carried to now where it ran none (as strings: Redis would truncate Lua numbers to
-- integers). A field written before `left` or `idle` existed (three or four figures) replies them as 0.
local key = KEYS[1] .. 'runs:' .. string.len(ARGV[1]) .. ':' .. ARGV[1]
local now = now_ms()
local own = {now, ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]}
local others = exchange(key, ARGV[2], tonumber(ARGV[3]), now, own, 5)
local out = {}
for _, other in ipairs(others) do
  local v = other[2]
  local since = math.max(0, now - v[2]) / 1000
  local idle = v[7] or 0
  if v[4] == 0 and idle > 0 then idle = idle + since end
  out[#out + 1] = other[1]
  out[#out + 1] = string.format('%.6f', v[3] + v[4] * since)
  for i = 4, 6 do out[#out + 1] = string.format('%.6f', v[i] or 0) end
  out[#out + 1] = string.format('%.6f', idle)
end
return out
"""
)
