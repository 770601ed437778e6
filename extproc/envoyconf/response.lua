-- The lean profile's response reader (Envoy Lua filter, response side only). See docs/architecture.md.
--
-- The sidecar admits a request on the ext_proc stream and, in its reply, writes dynamic metadata under the
-- `extproc` namespace: `id` (the key its end report is matched by) and `read`, a reading spec built from
-- the API's response dialect (extproc/admission/vocabulary/readspec.py): Lua patterns that mark a content event, a final
-- event, an error event and the usage-only event, the JSON key that holds usage (`usage_key`, quoted, for a
-- quick plain search; the usage pattern starts with it), and whether to strip the usage-only event (the
-- sidecar injected `stream_options.include_usage`; the client did not ask for it).
-- This script knows no API: it applies the patterns and writes what it saw to `extproc.response`, which
-- Envoy's gRPC access log hands to the sidecar when the request ends:
--   n  content events counted          m  n when the last usage object was seen
--   u0 the first usage object (text)   u  the last usage object (text)
--   f  a final event was seen          e  an error event was seen
--   x  the body ended (end of stream)  b  a JSON body, whole     t  the end of a larger JSON body
--   t1 when the first content event arrived (ms since the epoch, Envoy's clock): with the access log's
--      request start and last upstream byte it gives the sidecar the first-token delay and the decode rate
-- Envoy runs no Lua when a client disconnects, so every value is written as soon as it changes.
-- Handles from streamInfo() expire at each yield (every chunk): they are fetched again each time.
--
-- Cost: this runs for every token the fleet streams, so the per-chunk path does as little as it can
-- (bench/overhead/lua.py measures it, bench/RESULTS.md section 2c): event ends are found with plain
-- searches, not a pattern; an event that is the whole chunk (the usual case: one upstream write per token)
-- is not copied; a pattern runs only where its literal start (e.g. `"content"`) was found by a plain
-- search; a chunk's bytes are rebuilt only when an event is dropped or part of one is held back.

-- The metadata names, as extproc/admission/vocabulary/names.py defines them (NAMESPACE, RESPONSE_NAMESPACE,
-- READ_SPEC_KEY; the keys written to OUT are its ResponseField): tests/unit/envoyconf/
-- test_response_lua_names.py checks that the two agree.
local IN = "extproc"
local OUT = "extproc.response"
local SPEC = "read"
local HOLD_MAX = 65536 -- an incomplete SSE event is held (and, when stripping, withheld) up to this size
local BODY_MAX = 65536 -- a JSON body is handed over whole up to this size...
local TAIL = 8192 -- ...and past it only its end, where the usage object is written

local find, match, sub, byte = string.find, string.match, string.sub, string.byte
local concat = table.concat
local LF, CR = 10, 13

local function set(handle, key, value)
  handle:streamInfo():dynamicMetadata():set(OUT, key, value)
end

-- The literal text every match of a pattern starts with (`"content"` of `"content"%s*:%s*"[^"]`), or false
-- when it has none (anchored, or a class, a set or an optional character first). Kept per Lua state (one per
-- Envoy worker, living as long as the config): the specs' patterns are a few dozen fixed strings.
local LITERAL_CACHE_MAX = 256
local literals, cached = {}, 0
local MAGIC = "^$()%.[]*+-?"

local function literal_start(pattern)
  local known = literals[pattern]
  if known ~= nil then
    return known
  end
  local out, i = {}, 1
  while i <= #pattern do
    local c = sub(pattern, i, i)
    if c == "%" then
      c = sub(pattern, i + 1, i + 1)
      if c == "" or find(c, "%w") then
        break -- a class (%s, %d), %b or %f: not one fixed character
      end
      i = i + 2
    elseif find(MAGIC, c, 1, true) then
      break
    else
      i = i + 1
    end
    local quantifier = sub(pattern, i, i)
    if quantifier == "*" or quantifier == "?" or quantifier == "-" then
      break -- this character may be absent from a match
    end
    out[#out + 1] = c
    if quantifier == "+" then
      break
    end
  end
  local literal = #out > 0 and concat(out) or false
  if cached < LITERAL_CACHE_MAX then
    literals[pattern] = literal
    cached = cached + 1
  end
  return literal
end

-- Whether `text` matches one of `patterns`. No match can start before the first occurrence of a pattern's
-- literal start, so a plain search for it decides most events and the pattern runs only from there.
local function matches(text, patterns)
  if patterns ~= nil then
    for i = 1, #patterns do
      local pattern = patterns[i]
      local literal = literal_start(pattern)
      local from = 1
      if literal then
        from = find(text, literal, 1, true)
      end
      if from ~= nil and find(text, pattern, from) ~= nil then
        return true
      end
    end
  end
  return false
end

-- One complete SSE event: whether to drop it from the client's stream. Most events are content: those are
-- neither final nor errors, so the other patterns run only for the rest.
local function classify(event, spec, state)
  if matches(event, spec.content) and not matches(event, spec.not_content) then
    state.n = state.n + 1
  else
    if matches(event, spec.final) then
      state.final = true
    end
    if matches(event, spec.error) then
      state.error = true
    end
  end
  local at = find(event, spec.usage_key, 1, true)
  if at == nil then
    return false -- a plain search first: the usage pattern runs only where the key is
  end
  local usage = match(event, spec.usage, at)
  if usage ~= nil then
    if state.u0 == nil then
      state.u0 = usage
    end
    state.u = usage
    state.m = state.n
    return spec.strip and spec.only ~= nil and find(event, spec.only) ~= nil
  end
  return false
end

-- The last byte of the first event that ends at or after `pos`: its blank line is "\n\n", "\r\n\r\n",
-- "\n\r\n" or "\r\n\n" (what the pattern "\r?\n\r?\n" finds), searched for as plain newlines.
local function event_end(text, pos)
  while true do
    local at = find(text, "\n", pos, true)
    if at == nil then
      return nil
    end
    local after = byte(text, at + 1)
    if after == LF then
      return at + 1
    end
    if after == CR and byte(text, at + 2) == LF then
      return at + 2
    end
    pos = at + 1
  end
end

-- `text` without the byte ranges in `dropped` (pairs of first and last positions, in order) and without
-- what follows `upto`.
local function without(text, dropped, upto)
  local out, from = {}, 1
  if dropped ~= nil then
    for i = 1, #dropped, 2 do
      out[#out + 1] = sub(text, from, dropped[i] - 1)
      from = dropped[i + 1] + 1
    end
  end
  out[#out + 1] = sub(text, from, upto)
  return concat(out)
end

local function publish(handle, state, seen)
  if seen.n == 0 and state.n > 0 then
    set(handle, "t1", handle:timestamp())
  end
  if state.n ~= seen.n then
    set(handle, "n", state.n)
    seen.n = state.n
  end
  if state.u ~= seen.u then
    if seen.u == nil then
      set(handle, "u0", state.u0)
    end
    set(handle, "u", state.u)
    set(handle, "m", state.m)
    seen.u = state.u
  end
  if state.final and not seen.final then
    set(handle, "f", true)
    seen.final = true
  end
  if state.error and not seen.error then
    set(handle, "e", true)
    seen.error = true
  end
end

local function read_events(handle, spec)
  local state = { n = 0, m = 0, final = false, error = false }
  local seen = { n = 0, final = false, error = false }
  local strip = spec.strip == true
  local held = ""
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    local text = size > 0 and chunk:getBytes(0, size) or ""
    local was_held = #held > 0
    if was_held then
      text = held .. text
    end
    local length = #text
    local dropped = nil -- first and last positions of the events to drop, made on the first one
    local pos = 1
    local last = event_end(text, 1)
    while last ~= nil do
      local event = text
      if pos ~= 1 or last ~= length then
        event = sub(text, pos, last)
      end
      if classify(event, spec, state) then
        dropped = dropped or {}
        dropped[#dropped + 1] = pos
        dropped[#dropped + 1] = last
      end
      pos = last + 1
      last = event_end(text, pos)
    end
    held = pos <= length and sub(text, pos) or ""
    if #held > HOLD_MAX or (size == 0 and #held > 0) then
      held = "" -- too large to be a usage event, or the end of the stream (an empty last chunk): released
    end
    -- Only a stripping reader changes bytes, and only when it dropped an event or holds part of one:
    -- otherwise the chunk passes untouched (no copy). A counting reader keeps a partial event for parsing.
    if strip and (dropped ~= nil or was_held or #held > 0) then
      chunk:setBytes(without(text, dropped, length - #held))
    end
    publish(handle, state, seen)
  end
end

local function read_body(handle)
  local parts, size, tail = {}, 0, nil
  for chunk in handle:bodyChunks() do
    local length = chunk:length()
    if length > 0 then
      local bytes = chunk:getBytes(0, length)
      if tail == nil and size + length <= BODY_MAX then
        parts[#parts + 1] = bytes
      else
        tail = sub((tail or concat(parts)) .. bytes, -TAIL)
        parts = {}
      end
      size = size + length
    end
  end
  if tail == nil then
    set(handle, "b", concat(parts))
  else
    set(handle, "t", tail)
  end
end

function envoy_on_response(handle)
  local admitted = handle:streamInfo():dynamicMetadata():get(IN)
  local spec = admitted ~= nil and admitted[SPEC] or nil
  if spec == nil then
    return -- not admitted by the lean profile (refused, free path): nothing to read
  end
  local kind = handle:headers():get("content-type") or ""
  if find(kind, "text/event-stream", 1, true) ~= nil then
    read_events(handle, spec)
  else
    read_body(handle)
  end
  set(handle, "x", true)
end
