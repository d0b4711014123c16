-- acquire.lua: admit, book or refuse a batch of calls against every rule
-- of a quota, atomically, each as if alone after the ones before it. Only
-- admitted and booked calls are written; a refused call writes only its
-- class's demand.
--
-- KEYS and ARGV as in lib.lua. After the rules, ARGS.acquire: the caller,
-- what it last saw of the quota, its timing and policy, and each group's
-- size (internal/protocol). Then per lateness bucket, ARGS.late (see
-- note_timing in lib.lua); per scope after the first (the one of KEYS),
-- its pause key and one key per rule in rule order (a shared rule's as in
-- KEYS); per booking to give back, ARGS.give: the booking as its answer
-- gave it, and its scope (1..s); per call, ARGS.call: its id, unique
-- across the fleet; its cost; the longest wait it accepts (0 admits only
-- now); its lead, the least wait (docs/PROTOCOL.md 3.8); its scope (1..s);
-- for a call that moves its booking, that booking's place among those
-- given back (1..g), else 0; its class's name ("" under ArrivalOrder) and
-- priority (see Classes). All times are in µs.
--
-- Returns REPLY.acquire {now, pause, epoch, lost, margin, done, seq, paused,
-- paused_by}, then per call REPLY.answer {admitted, wait, remaining,
-- reason, blind_by, pause, noted, logged, room}:
--   now        the time the script used;
--   pause      until when the quota or scope 1's key is paused, or 0; in an
--              answer, the same for the call's scope;
--   epoch      the quota's epoch;
--   lost       1 when this script found that Redis lost the quota's data;
--   margin     the smallest margin in force of the guarded windows, or 0;
--   done       when the script ended, or now if short (LONG_WORK); a call
--              admitted now starts no earlier, and replies are timed from it;
--   seq        the quota's count of scripts run, this one included;
--   paused     until when the quota itself is paused, or 0;
--   paused_by  why (PAUSED_BY_* in lib.lua), or 0; a call's pause that ends
--              later is its key's, which only the vendor sets;
--   admitted   1 admitted (wait 0) or booked (wait > 0), else 0;
--   wait       from now to the slot; when refused, until it would fit;
--   remaining  units free now under the tightest rule after the call, its
--              class's own log included;
--   reason     REASON.admitted (0); refused: REASON.too_far (1), the slot is
--              beyond the wait accepted; REASON.busy (2), a concurrency rule
--              is full (wait: to its first lease's end); REASON.share (3),
--              over the share reserved after a Local outage (wait: its end);
--   blind_by   when a blind rule refused the call, why (PAUSED_BY_*), or 0;
--   noted      for a call admitted or booked, the rules whose class demand
--              counts it, rule i as bit 2^(i-1); else 0;
--   logged     the same for the rules whose class's own log holds it;
--   room       remaining under the rules alone: what a vendor's count is
--              read against.

local now = clock()

-- Long scripts read the clock again for done: over LONG_WORK log entries
-- read, written or dropped, a read by rank, or over LONG_CALLS calls.
-- Others answer now, saving a command (docs/PROTOCOL.md 2.2).
local LONG_WORK = 256
local LONG_CALLS = 16

-- load drops what left every window and reads the state r decides from.
local function load(r)
  if r.kind == LOG then
    -- r.kept covers the widest margin and the answers' lag.
    r.long = redis.call('ZREMRANGEBYSCORE', r.key, '-inf', str(now - r.kept)) > LONG_WORK
    r.n = redis.call('ZCOUNT', r.key, '(' .. str(now - r.window), '+inf')
    if r.blind then
      -- No scout yet: no unit since the rule's data began.
      r.scout_free = redis.call('ZCOUNT', r.key, str(r.since), '+inf') == 0
    end
  elseif r.kind == COUNTER then
    -- Buckets older than r.kept, which nothing counts, are dropped.
    local oldest = oldest_bucket(r, now)
    local kept = bucket_of(now, r.width) - math.ceil(r.kept / r.width)
    local raw = redis.call('HGETALL', r.key)
    r.counts, r.bs, r.n, r.scout_free = {}, {}, 0, r.blind
    for k = 1, #raw, 2 do
      local b, n = tonumber(raw[k]), tonumber(raw[k + 1])
      if b < kept or n <= 0 then
        redis.call('HDEL', r.key, raw[k])
      else
        r.counts[b] = n
        r.bs[#r.bs + 1] = b
        if b >= oldest then
          r.n = r.n + n
        end
        if (b + 1) * r.width > r.since then
          r.scout_free = false
        end
      end
    end
    table.sort(r.bs)
  elseif r.kind == BUCKET then
    r.tat = tat_of(r.key)
    if r.since > 0 then
      r.tat = math.max(r.tat, r.since + r.limit * r.interval)
    end
  elseif r.kind == CONCURRENCY then
    redis.call('ZREMRANGEBYSCORE', r.key, '-inf', str(now))
    r.n = redis.call('ZCARD', r.key)
    if now < r.since + r.lease then
      r.n, r.lost_until = r.limit, r.since + r.lease
    end
  else
    error('unknown rule kind ' .. tostring(r.kind))
  end
  r.tmax = now
end

-- free returns the units rule r has free now, bookings ahead counted.
local function free(r)
  if r.kind == BUCKET then
    return bucket_free(r, r.tat, now)
  elseif r.blind and r.kind ~= CONCURRENCY then
    return 0
  end
  return r.limit - r.n
end

-- blind.floor returns when a blind log or counter r admits a call: for a
-- scout, blind.settled (docs/PROTOCOL.md 6.1); else its blindness's end.
function blind.floor(r)
  if r.scout and r.about and r.scout_free then
    return blind.settled(r)
  end
  return r.blind_until
end

-- A log with at most SEGMENT entries after a search's start is read once
-- per script into r.seg. It is searched in memory (docs/PROTOCOL.md 3.2).
local SEGMENT = 1024

-- first_after returns the first i with s[i] > x in ascending s, or #s + 1.
local function first_after(s, x)
  local lo, hi = 1, #s + 1
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if s[mid] > x then
      hi = mid
    else
      lo = mid + 1
    end
  end
  return lo
end

-- seg_insert inserts n entries at score into the ascending scores s.
local function seg_insert(s, score, n)
  local at = first_after(s, score)
  for _ = 1, n do
    table.insert(s, at, score)
  end
end

-- record writes the call into the state the batch's next call decides from.
local function record(r, t, id, cost)
  r.tmax = math.max(r.tmax, t)
  r.recorded = true
  r.fits = nil
  r.scout_free = false
  if r.kind == LOG or r.kind == CONCURRENCY then
    local score = t
    if r.kind == CONCURRENCY then
      -- A concurrency slot is held from now, booked or not, to t + lease.
      score = t + r.lease
    end
    if score ~= r.at then
      -- The calls of a batch admitted now share one time, formatted once.
      r.at, r.at_str = score, str(score)
    end
    local p = r.pending or {}
    r.pending = p
    local n = #p
    for u = 1, cost do
      p[n + 1], p[n + 2] = r.at_str, member(id, u)
      n = n + 2
    end
    r.n = r.n + cost
    if r.seg and score > r.seg.lo then
      seg_insert(r.seg.s, score, cost)
    end
  elseif r.kind == COUNTER then
    local b = bucket_of(t, r.width)
    if not r.counts[b] then
      local i = #r.bs + 1
      while i > 1 and r.bs[i - 1] > b do
        i = i - 1
      end
      table.insert(r.bs, i, b)
    end
    r.counts[b] = (r.counts[b] or 0) + cost
    r.added = r.added or {}
    r.added[b] = (r.added[b] or 0) + cost
    r.n = r.n + cost
  else
    r.tat = math.max(r.tat, t) + cost * r.interval
    r.last_id = id
  end
end

-- flush writes what the batch recorded in rule r to Redis.
local function flush(r)
  if r.pending then
    for i = 1, #r.pending, 1000 do
      redis.call('ZADD', r.key, unpack(r.pending, i, math.min(i + 999, #r.pending)))
    end
    r.pending = nil
  elseif r.added then
    for b, n in pairs(r.added) do
      redis.call('HINCRBY', r.key, str(b), n)
    end
    r.added = nil
  elseif r.last_id then
    set_tat(r.key, r.tat, r.last_id, now)
    r.last_id = nil
  end
end

-- A call reads SCAN log entries at most, FIRST_READ to MAX_READ at a time.
local SCAN = OFF.read_budget and math.huge or 512
local FIRST_READ = 4
local MAX_READ = 256

-- scores returns the scores of ranks from .. from+n-1 (from 0) of key.
local function scores(key, from, n)
  local raw = redis.call('ZRANGE', key, from, from + n - 1, 'WITHSCORES')
  local out = {}
  for k = 2, #raw, 2 do
    out[#out + 1] = tonumber(raw[k])
  end
  return out
end

-- log_tail returns the earliest time >= t past the log's last entry and a
-- window after the entry with room entries after it. It always fits.
local function log_tail(r, t, room)
  flush(r)
  local total = redis.call('ZCARD', r.key)
  local last = redis.call('ZRANGE', r.key, -1, -1, 'WITHSCORES')
  local nth = redis.call('ZRANGE', r.key, total - 1 - room, total - 1 - room, 'WITHSCORES')
  return math.max(t, tonumber(last[2]), tonumber(nth[2]) + r.window)
end

-- segment returns log r's segment of every entry after lo, read if need
-- be. It is nil when over SEGMENT entries follow: earliest_log reads those.
local function segment(r, lo)
  local seg = r.seg
  if seg == false or seg and seg.lo <= lo then
    return seg or nil
  end
  flush(r)
  local raw = redis.call('ZRANGEBYSCORE', r.key, '(' .. str(lo), '+inf', 'WITHSCORES', 'LIMIT', 0, SEGMENT + 1)
  if #raw > 2 * SEGMENT then
    r.seg = false
    return nil
  end
  local s = {}
  for k = 2, #raw, 2 do
    s[#s + 1] = tonumber(raw[k])
  end
  r.long = r.long or #s > LONG_WORK
  r.seg = { lo = lo, s = s }
  return r.seg
end

-- earliest_in_segment is earliest_log in memory, over all scores after t - w.
local function earliest_in_segment(r, s, t, room, budget)
  local w = r.window
  local j = first_after(s, t - w)
  while true do
    local a, b = s[j], s[j + room]
    if b == nil or b - w >= t then
      return t
    end
    if budget.left <= 0 then
      return log_tail(r, t, room)
    end
    if b - a < w and t < a + w then
      t = a + w
    end
    j = j + 1
    budget.left = budget.left - 1
  end
end

-- earliest_log returns the earliest time >= t at which cost more units fit
-- the log. A window of length w = r.window may hold room = limit - cost
-- others. Room+1 entries within w forbid (s[j+room] - w, s[j] + w); one
-- pass finds the first allowed time (docs/PROTOCOL.md 3.2).
local function earliest_log(r, t, cost, budget)
  local room, w = r.limit - cost, r.window
  r.long = true
  flush(r)
  -- j is the rank of the first entry after t - w. a and b hold the scores
  -- from ranks j and j + room, read as needed.
  local j = redis.call('ZCOUNT', r.key, '-inf', str(t - w))
  local a, b, i, n = {}, {}, 1, FIRST_READ
  while true do
    if i > #a then
      if budget.left <= 0 then
        return log_tail(r, t, room)
      end
      a, b, i = scores(r.key, j, n), scores(r.key, j + room, n), 1
      budget.left = budget.left - 2 * n
      n = math.min(2 * n, MAX_READ)
      if #b == 0 then
        return t
      end
    end
    if i > #b then
      -- Fewer than room+1 entries from here on: no window can fill.
      return t
    end
    if b[i] - w >= t then
      return t
    end
    if b[i] - a[i] < w and t < a[i] + w then
      t = a[i] + w
    end
    if a[i + 1] == a[i] and a[#a] == a[i] then
      -- The next entries at its time (one call's units) forbid nothing new
      -- before t: skip them by rank rather than read them.
      j = redis.call('ZCOUNT', r.key, '-inf', str(a[i]))
      i, n = #a + 1, FIRST_READ
      budget.left = budget.left - 1
    else
      i, j = i + 1, j + 1
    end
    budget.left = budget.left - 1
  end
end

-- earliest_counter returns the earliest time >= t at which cost more units
-- fit a counter. The m+1 buckets from i on hold W(i); W(i) > limit - cost
-- forbids buckets i .. i+m. W changes only where a bucket in use enters or
-- leaves, so one sweep over r.bs finds k (docs/PROTOCOL.md 3.3).
local function earliest_counter(r, t, cost)
  local width, room = r.width, r.limit - cost
  if r.n <= room then
    return t
  end
  local m = math.ceil(r.window / width)
  local k0 = bucket_of(t, width)
  local k = k0
  local bs, counts = r.bs, r.counts
  local n = #bs
  local enter, leave, w = 1, 1, 0
  while leave <= n do
    -- The next place W changes; past k, no window can forbid k any more.
    local at = bs[leave] + 1
    if enter <= n then
      at = math.min(at, bs[enter] - m)
    end
    if at > k then
      break
    end
    while enter <= n and bs[enter] - m == at do
      w = w + counts[bs[enter]]
      enter = enter + 1
    end
    while leave <= n and bs[leave] + 1 == at do
      w = w - counts[bs[leave]]
      leave = leave + 1
    end
    if w > room then
      -- W holds until nxt: those windows forbid buckets up to nxt - 1 + m.
      local nxt = bs[leave] + 1
      if enter <= n then
        nxt = math.min(nxt, bs[enter] - m)
      end
      if nxt - 1 + m >= k then
        k = nxt + m
      end
    end
  end
  if k == k0 then
    return t
  end
  return k * width
end

-- paced returns the earliest time >= t at least pace from log r's entries.
local PACE_READ = 16
local PACED_SCAN = 32
local function paced(r, t, pace)
  flush(r)
  local raw = redis.call('ZRANGEBYSCORE', r.key, '(' .. str(t - pace), '+inf', 'WITHSCORES', 'LIMIT', 0, PACE_READ)
  for k = 2, #raw, 2 do
    local e = tonumber(raw[k])
    if e >= t + pace then
      return t
    end
    t = math.max(t, e + pace)
  end
  if #raw < 2 * PACE_READ then
    return t
  end
  local last = redis.call('ZRANGE', r.key, -1, -1, 'WITHSCORES')
  return math.max(t, tonumber(last[2]) + pace)
end

-- search_from returns where a search of log r from t begins, and its hint.
local function search_from(r, t, cost)
  local from = t
  if r.hint == nil then
    r.hint = read_hint(r)
  end
  local h = r.hint
  if h and h.c <= cost and h.t <= t and h.w <= r.window and h.at > from then
    from = h.at
  end
  return from, h
end

-- keep_hint makes log r's hint say that a search for cost units from t
-- found no room before at. h is the hint it began with. A search begun in
-- h's span keeps h's t. One begun past h.at leaves h, unless h.at is past.
local function keep_hint(r, h, t, cost, at)
  local joins = h and h.c <= cost and h.w <= r.window and h.t <= t and h.at >= t
  if not h or cost < h.c or h.t > t or h.w > r.window or cost == h.c and at > h.at and (joins or h.at < now) then
    local since = t
    if joins then
      since = h.t
    end
    r.hint = { t = since, at = at, c = cost, w = r.window }
    r.hint_changed = true
  end
end

-- earliest_in_log returns the earliest time >= t log r takes cost more units.
local function earliest_in_log(r, t, cost, budget)
  -- Only a log too full to take the call outright needs its entries read.
  if r.n <= r.limit - cost then
    return t
  end
  -- r.fits holds the last answer for the rounds, until a call is recorded.
  if r.fits and r.fits.c == cost and r.fits.at == t and not OFF.fits then
    return t
  end
  if r.n <= SEGMENT and not OFF.segment then
    -- Short: read whole into memory, with no hint to read or write.
    local seg = segment(r, t - r.window)
    if seg then
      local at = earliest_in_segment(r, seg.s, t, r.limit - cost, budget)
      r.fits = { c = cost, at = at }
      return at
    end
  end
  local from, h = search_from(r, t, cost)
  -- A search that settled for the log's tail leaves the hint there too.
  -- Deeper room stays unused until entries taken out lower the hint.
  local at = earliest_log(r, from, cost, budget)
  r.fits = { c = cost, at = at }
  keep_hint(r, h, t, cost, at)
  return at
end

-- earliest returns the earliest time >= t at which rule r takes cost more
-- units. A full concurrency rule gives NEVER: its holders' end is unknown.
local function earliest(r, t, cost, budget)
  if r.blind and (r.kind == LOG or r.kind == COUNTER) then
    t = math.max(t, blind.floor(r))
  end
  if r.kind == LOG then
    return earliest_in_log(r, t, cost, budget)
  elseif r.kind == COUNTER then
    return earliest_counter(r, t, cost)
  elseif r.kind == BUCKET then
    -- GCRA: the call conforms once its units fit in the burst above TAT.
    return math.max(t, r.tat - (r.limit - cost) * r.interval)
  elseif r.n + cost <= r.limit then
    return t
  end
  return NEVER
end

-- The script's steps share one table, batch: arguments and what each learns.

-- read_scopes reads the scopes into batch.scopes, returning the place after
-- them. A rule on scope 1's key is one object; batch.objs lists each once.
local function read_scopes(batch, arg)
  local rs = batch.rs
  batch.scopes = { { rs = rs, pause_key = KEYS[2] } }
  batch.objs = {}
  for i, r in ipairs(rs) do
    batch.objs[i] = r
  end
  for s = 2, batch.nscopes do
    local srs = {}
    local pause_key = ARGV[arg]
    arg = arg + 1
    for i, r in ipairs(rs) do
      local key = ARGV[arg]
      arg = arg + 1
      if key == r.key then
        srs[i] = r
      else
        local c = {}
        for k, v in pairs(r) do
          c[k] = v
        end
        c.key = key
        srs[i] = c
        batch.objs[#batch.objs + 1] = c
      end
    end
    batch.scopes[s] = { rs = srs, pause_key = pause_key }
  end
  return arg
end

-- call_args returns call c (from 0) of the batch; call it once. It adds
-- its cost read, scope rules, read_call's fields and the booking it moves.
local function call_args(batch, c)
  local call = batch.call_args[c + 1]
  call.index = c
  local sc = batch.scopes[call.scope]
  call.cost, call.scope, call.rs, call.pause = read_cost(call.cost), sc, sc.rs, sc.pause
  call.remaining, call.after, call.too_big, call.room, call.room_after = NEVER, NEVER, false, NEVER, NEVER
  call.moves = batch.given[call.moves]
  return call
end

-- read_args returns batch, holding the rules and the script's arguments.
local function read_args()
  local at = after_rules()
  local batch
  batch, at = ARGS.acquire(at)
  batch.rs = rules()
  if OFF.rebuild then
    batch.scout = 0
  end
  if batch.limiter == '' then
    batch.limiter = nil
  end
  if batch.lates > 0 then
    batch.report = {}
    for k = 1, batch.lates do
      batch.report[k], at = ARGS.late(at)
    end
  end
  batch.nscopes, batch.ncalls, batch.ngive = batch.scopes, batch.calls, batch.gives
  at = read_scopes(batch, at)
  batch.give_args = batch.ngive > 0 and {} or nil
  for g = 1, batch.ngive do
    local b
    b, at = ARGS.give(at)
    b.cost, b.scope = read_cost(b.cost), batch.scopes[b.scope]
    batch.give_args[g] = b
  end
  batch.call_args = {}
  for c = 1, batch.ncalls do
    batch.call_args[c], at = ARGS.call(at)
  end
  batch.at_once = false -- some call was admitted now
  batch.units = 0 -- the units the calls admitted and booked cost
  batch.given = {} -- the bookings given back, by their place from 1
  return batch
end

-- read_fleet returns the meta, nil when missing, with the caller's timing
-- folded in. It sets the margins in force and whether the quota warms up.
local function read_fleet(batch)
  local meta = read_meta(true)
  if meta and now - meta.refreshed > META_REFRESH then
    meta.refreshed = now
  end
  batch.span = longest_window(batch.rs)
  batch.start = starting(meta, now, batch.span) and not OFF.warm_up
  batch.warming = batch.start or meta ~= nil and meta.warm_until > now
  if meta then
    note_timing(meta, now, batch.report, batch.delay)
    roll_hold(meta, now)
  end
  batch.spread = fleet_spread(meta, now)
  batch.margin = margins(batch.objs, batch.spread, held_spread(meta, now), meta and meta.warm_held > now, lag_of(meta, now))
  return meta
end

-- describe keeps in meta m the policy text of the limiter made last. Its
-- time is the script's clock less its age in µs (docs/PROTOCOL.md 1.2).
local function describe(m, age, text)
  if text ~= '' and now - age >= m.policy_made then
    m.policy, m.policy_made = text, now - age
  end
end

-- check_meta finds a loss (docs/PROTOCOL.md 6.1-6.3) and counts this
-- script; batch.meta is the meta to write back, batch.found true on a loss.
local function check_meta(batch, meta)
  -- count_own counts this script in <meta key without meta>ran by limiter
  -- id. It returns true on a loss: found, or counted at most batch.ran in
  -- epoch batch.ran_in (docs/PROTOCOL.md 6.2). epoch is the one read.
  local function count_own(batch, meta, epoch, found)
    if not batch.limiter or OFF.epochs then
      return found
    end
    local key = string.sub(KEYS[1], 1, -5) .. 'ran'
    if meta.epoch ~= epoch then
      redis.call('DEL', key)
    end
    local n = redis.call('HINCRBY', key, batch.limiter, 1)
    if not found and batch.ran_in == meta.epoch and n <= batch.ran then
      lose(meta, now, batch.rs)
      redis.call('DEL', key)
      n, found = redis.call('HINCRBY', key, batch.limiter, 1), true
    end
    if n == 1 or meta.refreshed == now then
      redis.call('PEXPIRE', key, math.max(META_TTL, 2 * longest_window(batch.rs) / 1000))
    end
    return found
  end
  local created = meta == nil
  local epoch = meta and meta.epoch
  batch.pause_before = meta and meta.pause or 0
  local step = clock_back(meta, now)
  local _, found
  meta, _, found = check_loss(meta, now, batch.known, batch.rs, nil, batch.seen)
  if step > 0 then
    -- The step counts as a loss, unless one was found otherwise; what the
    -- rules hold ahead drops either way (batch.back, load_rules).
    if not found then
      local before = meta.pause
      lose(meta, now, batch.rs, PAUSED_BY_CLOCK)
      if meta.pause > before then
        meta.paused_by = PAUSED_BY_CLOCK
      end
    end
    found, batch.back = true, step
    -- policy_made is by the clock that went back; all describe again.
    meta.policy_made = 0
    -- A shared rule's data is of the old clock only until the first of
    -- its group's quotas meets the step: the others keep what it booked.
    -- A group that kept no time (its key lost) drops it, as before.
    batch.back_shared = meta.group_acquire > now + CLOCK_BACK or meta.group_acquire == 0 or OFF.group_clock
  end
  meta.seq = meta.seq + 1
  check_policy(meta, now, batch.policy, batch.rs, created)
  if meta.began ~= '' and string.find(meta.policies, batch.policy, 1, true) == 1 then
    -- The newest policy's calls drop the rules no longer blind.
    blind.begin(meta, now, batch.rs)
  end
  describe(meta, batch.age, batch.described)
  if not found and meta.epoch < batch.stepped then
    -- A forward step: the data is whole, so its epoch's bookings go back.
    -- The epoch, not the loss: the caller finds a reply stale by it.
    batch.whole_epoch = meta.epoch
    lose(meta, now, batch.rs, PAUSED_BY_CLOCK)
    found = true
  end
  if batch.start then
    meta.warm_until = now + batch.span
  end
  meta.last_acquire = now
  if GROUP then
    meta.group_acquire = now
  end
  batch.meta, batch.found = meta, count_own(batch, meta, epoch, found)
end

-- give_back_bookings takes the bookings given back out of their rules
-- first. Only the meta's epoch counts, or the epoch a forward step ended.
local function give_back_bookings(batch)
  for g = 0, batch.ngive - 1 do
    local b = batch.give_args[g + 1]
    if b.epoch == batch.meta.epoch or b.epoch == batch.whole_epoch then
      give_back(b.scope.rs, b.id, b.cost, b.slot, now)
      -- Its class demand stays until the calls are decided (leave_classes).
      change_classes(b.scope.rs, b.id, b.cost, NONE, b.slot, b, now, 'logs')
      batch.given[g + 1] = b
    end
  end
end

-- drop_ahead drops what rule r holds ahead of a clock gone back. Kept, it
-- would hold the rule full as long as the step (docs/PROTOCOL.md 5.8).
local function drop_ahead(r)
  if r.kind == LOG or r.kind == CONCURRENCY then
    redis.call('ZREMRANGEBYSCORE', r.key, '(' .. str(now), '+inf')
  end
  if r.kind == LOG then
    -- Only a log keeps a hint, and its caller declares no other rule's.
    redis.call('DEL', r.key .. ':next')
  elseif r.kind == COUNTER then
    local current = bucket_of(now, r.width)
    for _, b in ipairs(redis.call('HKEYS', r.key)) do
      if tonumber(b) > current then
        redis.call('HDEL', r.key, b)
      end
    end
  elseif r.kind == BUCKET then
    redis.call('DEL', r.key)
  end
end

-- back_key_pause moves a key's pause, set by a clock since gone back by
-- step, to the new clock (back_by in lib.lua). The quota's is in its meta.
local function back_key_pause(key, step)
  if key == KEYS[1] then
    return
  end
  local v = tonumber(redis.call('GET', key) or '0')
  if v > now then
    redis.call('SET', key, str(back_by(v, step, now)), 'KEEPTTL')
  end
end

-- load_rules loads every rule, raises the caps the fleet fills, reads pauses.
local function load_rules(batch)
  local shared = false
  for _, r in ipairs(batch.rs) do
    shared = shared or not r.per_key
  end
  for _, r in ipairs(batch.objs) do
    blind.read(r, batch.meta, now)
    -- Scouts go only where the vendor's counts reach (rulesAbout in Go).
    r.scout = batch.scout == 1 or batch.scout == 2 and batch.meta.counted > 0
    r.about = r.kind ~= CONCURRENCY and (not r.per_key or not shared)
    if batch.back and (batch.back_shared or not (GROUP and r.shared)) then
      drop_ahead(r)
    end
    load(r)
  end
  if batch.back then
    for _, sc in ipairs(batch.scopes) do
      back_key_pause(sc.pause_key, batch.back)
    end
  end
  raise_caps(batch.objs, batch.meta, now)
  for _, sc in ipairs(batch.scopes) do
    sc.pause = pause_until(batch.meta.pause, sc.pause_key)
  end
end

-- Warm-up pacing (docs/PROTOCOL.md 3.9): a warming quota's lone call is
-- paced when the latest WARM_PACERS entries are other limiters' lone calls.
local WARM_PACERS = 8

-- crowded reports whether log r's latest WARM_PACERS entries are calls of
-- as many limiters other than own. The latest must be under pace ago.
local function crowded(r, own, pace)
  local last = redis.call('ZRANGE', r.key, -WARM_PACERS, -1, 'WITHSCORES')
  if #last == 2 * WARM_PACERS and tonumber(last[#last]) > now - pace then
    local others, n = {}, 0
    for i = 1, #last, 2 do
      local l = string.match(last[i], '^(.*):')
      if l ~= own and not others[l] then
        others[l], n = true, n + 1
      end
    end
    return n == WARM_PACERS
  end
  return false
end

-- pace_warm_start paces a warming script's one call where others crowd.
local function pace_warm_start(batch)
  if not batch.warming or batch.ncalls ~= 1 or OFF.warm_pacing then
    return
  end
  local c = batch.call_args[1]
  local own = string.match(c.id, '^(.*):')
  for _, r in ipairs(batch.scopes[c.scope].rs) do
    if r.kind == LOG and r.margin >= GUARDED and not r.pace then
      local pace = math.floor((r.window - r.margin) / r.limit)
      if crowded(r, own, pace) then
        r.pace = pace
      end
    end
  end
end

-- Classes (docs/PROTOCOL.md 3.13): a priority and, under a rule every key
-- shares, a key. ':cl' keeps what each class booked and waited, by period
-- of a quarter window. A call also books in its class's own log,
-- ':c:<class>', whose limit is the rule's less class_hold. The rule's own
-- log holds every call, so a class measured wrong costs room, never the cap.
local CLASS_KEPT = 6
local CLASS_FLOOR = 10
local CLASS_TTL = 60000
-- The ':cl' field of when a new class was last told; no name starts '~'.
local CLASS_TOLD = '~told'

-- read_class reads class name of rule r from its field v of ':cl'. It goes
-- into r.cls, or r.cls_gone when no period of it is left from oldest on.
local function read_class(r, name, v, oldest)
  local c, any = { p = {}, w = {}, a = {}, prio = tonumber(string.match(name, '^(%-?%d+)') or '0') }, false
  for pi, u, w, a in string.gmatch(v, CLASS_PART) do
    pi = tonumber(pi)
    if pi >= oldest then
      c.p[pi], c.w[pi], c.a[pi], any = tonumber(u), tonumber(w), tonumber(a) or 0, true
    end
  end
  if any then
    r.cls[name] = c
  else
    r.cls_gone[#r.cls_gone + 1] = name
  end
end

-- read_classes reads rule r's classes into r.cls, once per script.
local function read_classes(r)
  if r.cls then
    return
  end
  r.cls, r.cls_gone, r.cls_add = {}, {}, {}
  local raw = redis.call('HGETALL', r.key .. ':cl')
  local oldest = class_period(r, now) - CLASS_KEPT
  for i = 1, #raw, 2 do
    if raw[i] == CLASS_TOLD then
      r.cls_told = tonumber(raw[i + 1])
    else
      read_class(r, raw[i], raw[i + 1], oldest)
    end
  end
end

-- demand returns the units per window in force class c of rule r books,
-- in thousandths so sums stay exact. It is the most booked in four periods
-- in a row, scaled up while c is young, plus what waited.
local function demand(r, c)
  if c.d then
    return c.d
  end
  local ps = {}
  for pi in pairs(c.p) do
    ps[#ps + 1] = pi
  end
  table.sort(ps)
  local d = 0
  local cur = class_period(r, now)
  for i = 1, #ps do
    if ps[i] >= cur - CLASS_PERIODS then
      local sum, j = 0, i
      while j <= #ps and ps[j] < ps[i] + CLASS_PERIODS do
        local u = c.p[ps[j]]
        if ps[j] <= cur - CLASS_PERIODS and not OFF.class_backlog then
          -- Units booked ahead into the oldest period read, a window
          -- back, are a backlog leaving the window: they count no more.
          u = math.max(u - (c.a[ps[j]] or 0), 0)
        end
        sum, j = sum + u, j + 1
      end
      d = math.max(d, sum)
    end
  end
  local age = math.max(ps[#ps], cur) - ps[1] + 1
  d = d * 1000
  c.young = age < CLASS_PERIODS
  if c.young then
    d = math.floor(d * CLASS_PERIODS / age)
  end
  -- What waited or was refused in the last window counts too. A FailFast
  -- class shows demand only so, and a queue drains within a window.
  for pi = cur - CLASS_PERIODS + 1, cur do
    d = d + (c.w[pi] or 0) * 1000
  end
  -- Scaled from the vendor's window (four periods) to the window in force.
  c.d = math.floor(d * r.window / span_of(r))
  return c.d
end

-- fair_share returns the max-min fair share of room among demands ds.
-- Each demand under it is met whole; each above it gets it.
local function fair_share(ds, room)
  table.sort(ds)
  for i, d in ipairs(ds) do
    local level = math.floor(room / (#ds - i + 1))
    if d > level then
      return level
    end
    room = room - d
  end
  return NEVER
end

-- class_hold returns what rule r holds against class name at prio: higher
-- classes' demand, a young one's a tenth at least. Lighter peers' demand
-- counts up to the fair share. While name could fill the rule, so does
-- each lower class's, up to a tenth. A thirty-second and one unit are
-- added, and every class keeps a tenth.
local function class_hold(r, name, prio)
  local own = r.cls[name]
  local mine = own and demand(r, own) or 0
  local floor = math.max(math.floor(r.limit / CLASS_FLOOR), 1)
  local above, lower, peers, lighter = 0, 0, { mine }, {}
  for n, c in pairs(r.cls) do
    if n ~= name then
      local d = demand(r, c)
      if c.prio > prio then
        -- A class younger than a window has shown too little of its demand.
        above = above + (c.young and math.max(d, floor * 1000) or d)
      elseif c.prio < prio then
        lower = lower + math.min(d, floor * 1000)
      else
        peers[#peers + 1] = d
        if d < mine then
          lighter[#lighter + 1] = d
        end
      end
    end
  end
  local hold = above
  local fair = fair_share(peers, math.max(r.limit * 1000 - above, 0))
  for _, d in ipairs(lighter) do
    hold = hold + math.min(d, fair)
  end
  if mine + hold >= (r.limit - floor) * 1000 then
    hold = hold + lower
  end
  if hold == 0 then
    return 0
  end
  hold = math.ceil(hold / 1000)
  return math.min(hold + math.floor(hold / 32) + 1, r.limit - floor)
end

-- class_rule returns rule r's log or counter of class name's calls alone.
local function class_rule(batch, r, name)
  r.vrules = r.vrules or {}
  local v = r.vrules[name]
  if v then
    return v
  end
  v = {}
  for k, x in pairs(r) do
    v[k] = x
  end
  v.key = r.key .. ':c:' .. name
  v.cls, v.cls_gone, v.cls_add, v.vrules = nil, nil, nil, nil
  v.hint, v.hint_changed, v.fits, v.seg, v.pending, v.added = nil, nil, nil, nil, nil, nil
  v.recorded, v.at, v.at_str, v.long, v.cap, v.oth = nil, nil, nil, nil, nil, nil
  load(v)
  r.vrules[name] = v
  batch.objs[#batch.objs + 1] = v
  return v
end

-- classes_until makes the meta say rule r may hold class shares until two
-- windows after t. Calls of the default class ("0") read classes until then.
local function classes_until(batch, r, t)
  local m = batch.meta
  m.classes_until = math.max(m.classes_until, math.max(t, now) + 2 * span_of(r))
end

-- announce_class tells calls booked ahead to book again (announce_lowered):
-- class name is new to rule r. Once a period per rule, while any are ahead.
local function announce_class(batch, r, name)
  if OFF.class_news or r.cls[name] or r.cls_add[name] then
    return
  end
  local cur = class_period(r, now)
  if (r.cls_told or cur - 1) >= cur or not booked_ahead({ r }, now) then
    return
  end
  r.cls_told = cur
  redis.call('HSET', r.key .. ':cl', CLASS_TOLD, cur)
  announce_lowered(batch.meta, now, r.shared)
end

-- fill_default copies the rule's entries up to now into the default
-- class's log, the newest BACKFILL at most. It runs when a first other
-- class calls, so all are default-class calls. Bookings ahead are not
-- copied (docs/PROTOCOL.md 3.13).
local BACKFILL = 4096

local function fill_default(r)
  if r.filled or OFF.class_logs then
    return
  end
  r.filled = true
  flush(r)
  local to, latest = r.key .. ':c:0', nil
  if r.kind == LOG then
    local lo, hi = '(' .. str(now - r.keep), str(now)
    local n = redis.call('ZCOUNT', r.key, lo, hi)
    local raw = redis.call('ZRANGEBYSCORE', r.key, lo, hi, 'WITHSCORES', 'LIMIT', math.max(n - BACKFILL, 0), BACKFILL)
    local args = {}
    for i = 1, #raw, 2 do
      args[#args + 1], args[#args + 2] = raw[i + 1], raw[i]
      if #args >= 1000 or i + 1 == #raw then
        redis.call('ZADD', to, unpack(args))
        args = {}
      end
      latest = tonumber(raw[i + 1])
    end
    if latest then
      expire(to, math.max((latest - now + r.keep) / 1000, CLASS_TTL))
    end
  elseif r.kind == COUNTER then
    local raw, upto, args = redis.call('HGETALL', r.key), bucket_of(now, r.width), {}
    for i = 1, #raw, 2 do
      if tonumber(raw[i]) <= upto then
        args[#args + 1], args[#args + 2] = raw[i], raw[i + 1]
        latest = math.max(latest or 0, (tonumber(raw[i]) + 1) * r.width)
      end
    end
    if latest then
      redis.call('HSET', to, unpack(args))
      expire(to, math.max((latest - now + r.keep + r.width) / 1000, CLASS_TTL))
    end
  end
end

-- class_rules adds to call's rules its class's rule under each log and
-- counter that serves classes; call.classes notes where the call counts.
local function class_rules(batch, call)
  if OFF.classes or call.class == '' then
    return
  end
  local rs
  for _, r in ipairs(call.rs) do
    if (r.kind == LOG or r.kind == COUNTER) and not r.class_of then
      local name = class_name(r, call.class, call.prio)
      if name ~= '0' then
        classes_until(batch, r, now)
      end
      if name ~= '0' or batch.meta.classes_until > now then
        read_classes(r)
      end
      if name ~= '0' then
        announce_class(batch, r, name)
        if not next(r.cls) then
          fill_default(r)
        end
      end
      if r.cls and (next(r.cls) or name ~= '0') then
        call.classes = call.classes or {}
        local cc = { r = r, name = name }
        call.classes[#call.classes + 1] = cc
        local hold = class_hold(r, name, call.prio)
        cc.logged = hold > 0 or not OFF.class_logs
        if cc.logged then
          local v = class_rule(batch, r, name)
          v.class_of = r
          local lim = math.max(r.limit - hold, units(r, call.cost))
          if v.limit ~= lim then
            v.limit, v.fits = lim, nil
          end
          if hold > 0 then
            rs = rs or { unpack(call.rs) }
            rs[#rs + 1] = v
          else
            -- Nothing held against it: logged, not searched.
            call.also = call.also or {}
            call.also[#call.also + 1] = v
          end
        end
      end
    end
  end
  call.rs = rs or call.rs
end

-- note_classes adds call's units to its classes' demand, booked at t or
-- refused (t nil). A call that waits or is refused counts as waited too.
local function note_classes(batch, call, t)
  for _, cc in ipairs(call.classes or {}) do
    local r = cc.r
    if t and cc.name ~= '0' then
      classes_until(batch, r, t)
    end
    local add = r.cls_add[cc.name] or { p = {}, w = {}, a = {} }
    r.cls_add[cc.name] = add
    local u = units(r, call.cost)
    if t then
      local pi = class_period(r, t)
      add.p[pi] = (add.p[pi] or 0) + u
      if t > now then
        add.a[pi] = (add.a[pi] or 0) + u
      end
    end
    if not t or t > now then
      local pi = class_period(r, now)
      add.w[pi] = (add.w[pi] or 0) + u
    end
  end
end

-- write_classes writes back rule r's classes the batch changed and drops
-- those gone. The hash lives a window and a half past its latest period.
local function write_classes(r)
  if not r.cls_add then
    return
  end
  -- In chunks, as zadd in lib.lua: thousands of classes may leave at once.
  for i = 1, #r.cls_gone, 1000 do
    redis.call('HDEL', r.key .. ':cl', unpack(r.cls_gone, i, math.min(i + 999, #r.cls_gone)))
  end
  local oldest, latest = class_period(r, now) - CLASS_KEPT, nil
  for name, add in pairs(r.cls_add) do
    local c = r.cls[name] or { p = {}, w = {}, a = {} }
    local parts = {}
    for pi, u in pairs(add.p) do
      c.p[pi] = (c.p[pi] or 0) + u
    end
    for pi, u in pairs(add.a) do
      c.a[pi] = (c.a[pi] or 0) + u
    end
    for pi, w in pairs(add.w) do
      c.p[pi] = c.p[pi] or 0
      c.w[pi] = (c.w[pi] or 0) + w
    end
    for pi, u in pairs(c.p) do
      if pi >= oldest then
        parts[#parts + 1] = class_part(pi, u, c.w[pi] or 0, c.a[pi] or 0)
        latest = math.max(latest or pi, pi)
      end
    end
    redis.call('HSET', r.key .. ':cl', name, table.concat(parts, ','))
  end
  if latest then
    local period = math.max(math.floor(span_of(r) / CLASS_PERIODS), 1)
    local ms = ((latest + 1) * period - now + span_of(r) * CLASS_KEPT / CLASS_PERIODS) / 1000
    expire(r.key .. ':cl', math.max(ms, CLASS_TTL))
  end
end

-- leave_classes takes the bookings given back out of their classes'
-- demand once the calls are decided, lest a class booking again lose it.
local function leave_classes(batch)
  for _, b in pairs(batch.given) do
    change_classes(b.scope.rs, b.id, b.cost, NONE, b.slot, b, now, 'demand')
  end
end

-- read_call reads call c, with the units free under its scope's tightest
-- rule now and after it (class logs included; room: the rules alone). It
-- returns an error reply instead for a cost above a configured limit.
local function read_call(batch, c)
  local call = call_args(batch, c)
  class_rules(batch, call)
  for _, r in ipairs(call.rs) do
    local u = units(r, call.cost)
    if r.conf < u then
      return nil, redis.error_reply('cost ' .. u .. ' exceeds limit ' .. r.conf)
    elseif r.limit < u then
      -- Only while the quota is reserved, or a learned cap is below cost.
      call.too_big = true
    end
    local f = free(r)
    call.remaining = math.min(call.remaining, math.max(f, 0))
    call.after = math.min(call.after, math.max(f - u, 0))
    if not r.class_of then
      -- The rule's own room, which a vendor's count is read against.
      call.room = math.min(call.room, math.max(f, 0))
      call.room_after = math.min(call.room_after, math.max(f - u, 0))
    end
  end
  if call.pause > now then
    -- Nothing is free while the vendor asked for quiet.
    call.remaining, call.after, call.room, call.room_after = 0, 0, 0, 0
  end
  return call
end

-- start_from returns when the call's search starts, and whether to search
-- at all. It is no earlier than the call's lead and its scope's pause.
local function start_from(batch, call)
  local t = math.max(now + call.lead, call.pause)
  if not call.too_big then
    return t, true
  end
  for _, r in ipairs(call.rs) do
    if (r.whole and r.whole.limit or r.limit) < units(r, call.cost) then
      -- Larger than a learned cap: refused, with when the cap may have risen.
      call.maxwait = -1
      return math.max(t, r.cap and r.cap.next + span_of(r) or t), false
    end
  end
  -- Larger than the reserved share only: refused until the reserve ends,
  -- when every replica has handed back (docs/PROTOCOL.md 3.10).
  call.reserved_until = batch.meta.reserved_until
  return NEVER, false
end

-- paced_all returns the earliest time >= t every paced log of rs allows,
-- and every counter that leaves others a share, for cost more units.
local function paced_all(rs, t, cost)
  local p = t
  for _, r in ipairs(rs) do
    local pace = r.pace
    if r.share_per then
      -- A counter keeps no entries to pace from: once half the limit in
      -- force is in the window ending at a bucket, the bucket takes at
      -- most share_per units (docs/PROTOCOL.md 3.11).
      local width, counts, c = r.width, r.counts, units(r, cost)
      local m, k = math.ceil(r.window / width), bucket_of(t, width)
      local w = 0
      for b = k - m, k do
        w = w + (counts[b] or 0)
      end
      for _ = 0, m do
        if 2 * w < r.limit or (counts[k] or 0) + c <= r.share_per then
          p = math.max(p, k * width)
          break
        end
        w = w + (counts[k + 1] or 0) - (counts[k - m] or 0)
        k = k + 1
      end
    end
    if not pace and r.share_pace then
      -- A share's pace holds once half the limit in force is in the
      -- window: a few calls go at once (docs/PROTOCOL.md 3.11).
      flush(r)
      if 2 * redis.call('ZCOUNT', r.key, '(' .. str(t - span_of(r)), str(t)) >= r.limit then
        pace = r.share_pace
      end
    end
    if pace and pace > 0 then
      p = math.max(p, paced(r, t, pace))
    end
  end
  return p
end

-- settle returns the earliest time from t that every rule of the call
-- allows, paced if the call may wait that long. It is NEVER when a rule
-- cannot say. After 16 rounds, the logs settle for their tails
-- (docs/PROTOCOL.md 3.1).
local budget = { left = SCAN } -- each call's, set anew by settle

local function settle(call, t, moved)
  budget.left = SCAN
  local rounds = 0
  local paces, unpaced = call.maxwait > 0 and 2 or 0, nil
  while moved and t < NEVER do
    moved = false
    rounds = rounds + 1
    if rounds > 16 then
      budget.left = 0
    end
    for _, r in ipairs(call.rs) do
      local u = earliest(r, t, units(r, call.cost), budget)
      if u > t then
        t = u
        moved = true
        if t == NEVER then
          break
        end
      end
    end
    if not moved and paces > 0 and t < NEVER then
      -- Paced once the rules agree, if the call may wait that long; they
      -- settle again within PACED_SCAN entries (docs/PROTOCOL.md 3.9).
      paces = paces - 1
      local p = paced_all(call.rs, t, call.cost)
      if p > t and p - now <= call.maxwait then
        unpaced, t, moved = unpaced or t, p, true
        budget.left = math.min(budget.left, PACED_SCAN)
      end
    end
  end
  if unpaced and t - now > call.maxwait then
    -- Pacing is a preference: it never refuses a call that fits.
    t = unpaced
  end
  return t
end

-- busy_for returns how long until each full concurrency rule frees a slot.
local function busy_for(rs, cost)
  local hint = 0
  for _, r in ipairs(rs) do
    if r.kind == CONCURRENCY and r.n + units(r, cost) > r.limit then
      flush(r)
      local head = redis.call('ZRANGE', r.key, 0, 0, 'WITHSCORES')
      local free_at = r.lost_until or tonumber(head[2] or now)
      hint = math.max(hint, free_at - now)
    end
  end
  return hint
end

-- blind.cause returns why a blind rule refused the call, or 0. With busy it
-- is a concurrency rule; else a log or counter beyond the call's wait.
function blind.cause(call, busy)
  for _, r in ipairs(call.rs) do
    if r.blind and busy == (r.kind == CONCURRENCY) and
        (busy or r.kind ~= BUCKET and blind.floor(r) - now > call.maxwait) then
      return r.blind_by
    end
  end
  return 0
end

-- blind.scouts reports whether the call, admitted at t, is a scout: a blind
-- log or counter takes it before its blindness ends.
function blind.scouts(call, t)
  for _, r in ipairs(call.rs) do
    if r.blind and (r.kind == LOG or r.kind == COUNTER) and t < r.blind_until then
      return true
    end
  end
  return false
end

-- answer writes call's answer at its place in the reply (see the header):
-- the calls may be decided out of their order (moves.order).
local function answer(batch, call, admitted, wait, reason, blind_by)
  local out = batch.out
  local n = REPLY.acquire.size + call.index * REPLY.answer.size
  out[n + REPLY.answer.admitted] = admitted
  out[n + REPLY.answer.wait] = wait == 0 and 0 or str(wait)
  out[n + REPLY.answer.remaining] = call.remaining
  out[n + REPLY.answer.reason] = reason
  out[n + REPLY.answer.blind_by] = blind_by or 0
  out[n + REPLY.answer.pause] = call.pause == 0 and 0 or str(call.pause)
  local noted, logged = 0, 0
  if admitted == 1 then
    for _, cc in ipairs(call.classes or {}) do
      noted = noted + 2 ^ (cc.r.i - 1)
      logged = logged + (cc.logged and 2 ^ (cc.r.i - 1) or 0)
    end
  end
  out[n + REPLY.answer.noted], out[n + REPLY.answer.logged], out[n + REPLY.answer.room] = noted, logged, call.room
end

-- A move's steps: the order of a script call's decisions, and the check
-- of a slot kept.
local moves = {}

-- moves.order returns the calls' places (from 0): the moves whose own
-- booking was given back first, then the others as they came. A move
-- that finds nothing earlier keeps its slot; a call decided before it
-- could take the units its booking gave back there (seed 304023: a move
-- of a booking of a lost epoch, decided as a new call, took them).
function moves.order(batch)
  local first, rest = {}, {}
  for c = 0, batch.ncalls - 1 do
    local m = batch.call_args[c + 1].moves
    if m > 0 and batch.given[m] and not OFF.moves_first then
      first[#first + 1] = c
    else
      rest[#rest + 1] = c
    end
  end
  for _, c in ipairs(rest) do
    first[#first + 1] = c
  end
  return first
end

-- moves.fits_behind reports whether the call's units still fit, at its
-- slot, each window of its searched logs and counters that ends there,
-- and each of its concurrency rules now: the check a kept move passes.
-- When every booking at or before a slot passes it, so does every window
-- through the slot; the bookings after it are checked when they move or
-- are decided, so a limit in force lowered since the call was booked
-- (a cap, the others' share, a class's hold) keeps the calls at the front
-- in their places and sends the last back (docs/PROTOCOL.md 3.8). A
-- token bucket's one time holds the bookings after the slot too: it keeps
-- its slot unchecked, as before, and its caller books again.
function moves.fits_behind(call, slot)
  for _, r in ipairs(call.rs) do
    local u = units(r, call.cost)
    if r.blind and r.kind ~= BUCKET then
      return false
    elseif r.kind == LOG then
      flush(r)
      if redis.call('ZCOUNT', r.key, '(' .. str(slot - r.window), str(slot)) + u > r.limit then
        return false
      end
    elseif r.kind == COUNTER then
      local k, from, n = bucket_of(slot, r.width), oldest_bucket(r, slot), u
      for b, m in pairs(r.counts) do
        if b >= from and b <= k then
          n = n + m
        end
      end
      if n > r.limit then
        return false
      end
    elseif r.kind == CONCURRENCY and r.n + u > r.limit then
      return false
    end
  end
  return true
end

-- decide decides call c and writes its answer: refused, or recorded at
-- its slot. A move finding nothing earlier keeps its slot if it still fits
-- there (moves.fits_behind), else it is refused and its caller books again. It
-- returns an error reply for a call no rule can ever take.
local function decide(batch, c)
  local call, err = read_call(batch, c)
  if err then
    return err
  end
  local t, moved = start_from(batch, call)
  t = settle(call, t, moved)
  local refused = call.reserved_until or t == NEVER or t - now > call.maxwait
    or call.moves and t >= call.moves.slot
  if call.moves and refused and (OFF.keep_place or moves.fits_behind(call, call.moves.slot)) then
    t, refused, call.moves.kept = call.moves.slot, false, true
  end
  if refused then
    note_classes(batch, call, nil)
  end
  if call.reserved_until and refused then
    answer(batch, call, 0, call.reserved_until - now, REASON.share)
  elseif t == NEVER then
    answer(batch, call, 0, busy_for(call.rs, call.cost), REASON.busy, blind.cause(call, true))
  elseif refused then
    answer(batch, call, 0, t - now, REASON.too_far, blind.cause(call, false))
  else
    local scout = blind.scouts(call, t)
    for _, r in ipairs(call.rs) do
      record(r, t, call.id, units(r, call.cost))
    end
    for _, v in ipairs(call.also or {}) do
      record(v, t, call.id, units(v, call.cost))
    end
    note_classes(batch, call, t)
    batch.units = batch.units + call.cost.total
    call.remaining, call.room = call.after, call.room_after
    if t > now or call.moves and call.moves.kept then
      call.remaining, call.room = 0, 0
    end
    if scout then
      -- Any count the vendor gives of a scout is news (docs/PROTOCOL.md 6.1).
      call.room = -1
    end
    if t <= now then
      batch.at_once = true
    end
    answer(batch, call, 1, t - now, REASON.admitted)
  end
end

-- write_back_meta writes the meta, which seq changes in every script, with
-- the holds (docs/PROTOCOL.md 5.6, 5.7). It tells the fleet of a loss found
-- or a pause that grew.
local function write_back_meta(batch)
  local meta, latest = batch.meta, 0
  for _, r in ipairs(batch.objs) do
    if r.recorded then
      latest = math.max(latest, r.tmax)
    end
  end
  if batch.warming and batch.at_once then
    meta.warm_held = math.max(meta.warm_held, now + warm_hold(batch.rs))
  end
  if latest > 0 then
    hold_spread(meta, now, batch.spread, latest, batch.rs)
  end
  write_meta(meta, batch.rs)
  if batch.found or meta.pause > batch.pause_before and meta.pause > now then
    announce_quota(meta, now)
  end
end

-- write_back_rules writes what the calls recorded in every rule, and the
-- hints that moved. Each key outlives its latest entry by a window.
local function write_back_rules(objs)
  for _, r in ipairs(objs) do
    flush(r)
    write_classes(r)
    if r.hint_changed then
      write_hint(r, now)
    end
    -- A class's log lives a minute at least, lest a Redis clock apart from
    -- the scripts' (see SLACK) drop it between two writes.
    local least = r.class_of and CLASS_TTL or 0
    if not r.recorded then
      -- nothing to keep
    elseif r.kind == LOG then
      expire(r.key, math.max((r.tmax - now + r.kept) / 1000, least))
    elseif r.kind == COUNTER then
      expire(r.key, math.max((r.tmax - now + r.kept + r.width) / 1000, least))
    elseif r.kind == CONCURRENCY then
      expire(r.key, (r.tmax - now + r.lease) / 1000)
    end
  end
end

local batch = read_args()
check_meta(batch, read_fleet(batch))
batch.reserved = limits_in_force(batch.objs, batch.meta, now)
give_back_bookings(batch)
load_rules(batch)
pace_warm_start(batch)
-- The reply's header; done is set once the calls are decided and written.
local quota_paused = batch.meta.pause > now
batch.out = {}
batch.out[REPLY.acquire.now], batch.out[REPLY.acquire.pause] = str(now), str(batch.scopes[1].pause)
batch.out[REPLY.acquire.epoch], batch.out[REPLY.acquire.lost] = str(batch.meta.epoch), batch.found and 1 or 0
batch.out[REPLY.acquire.margin], batch.out[REPLY.acquire.done] = str(batch.margin), 0
batch.out[REPLY.acquire.seq] = str(batch.meta.seq)
batch.out[REPLY.acquire.paused] = quota_paused and str(batch.meta.pause) or 0
batch.out[REPLY.acquire.paused_by] = quota_paused and batch.meta.paused_by or 0
for _, c in ipairs(moves.order(batch)) do
  local err = decide(batch, c)
  if err then
    return err
  end
end
write_back_meta(batch)
write_back_rules(batch.objs)
leave_classes(batch)
local long = batch.ncalls > LONG_CALLS or batch.units > LONG_WORK
for _, r in ipairs(batch.objs) do
  long = long or r.long
end
batch.out[REPLY.acquire.done] = (long or OFF.lazy_done) and str(clock()) or str(now)
return batch.out
