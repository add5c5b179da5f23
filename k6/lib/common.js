// Shared helpers for the ledger-limiter k6 scenarios (k6 v1.1.0).
//
// Environment:
//   BASE_URL  where the service listens (default http://127.0.0.1:8080)
//   RUN_ID    prefix that keeps each run's callers (and so their ledger accounts) apart;
//             default: a random string made once per run in setup()
//
// No `traceparent` is sent: the service samples a request without one (its sampler is parent-based,
// always on by default) and its span is the trace's root. A made-up parent left every trace
// reached from an exemplar without its root span.

import http from 'k6/http';
import { check } from 'k6';
import { Rate } from 'k6/metrics';

export const BASE_URL = (__ENV.BASE_URL || 'http://127.0.0.1:8080').replace(/\/+$/, '');

// The demo configuration the service ships with (see the service's plan config). `limit` requests
// per sliding `windowSeconds`: each admitted request holds one unit for the whole window.
export const PLANS = {
  free: { limit: 5, windowSeconds: 30 },
  basic: { limit: 50, windowSeconds: 30 },
  pro: { limit: 500, windowSeconds: 30 },
};

// Responses from the limited route are either admitted (200) or limited (429); anything else is
// unexpected. Telling k6 that 429 is an expected status keeps http_req_failed meaningful.
http.setResponseCallback(http.expectedStatuses(200, 429));

// Custom metrics shared by every scenario.
export const admitted = new Rate('admitted'); // true on 200, false on 429 (not added otherwise)
export const unexpectedStatus = new Rate('unexpected_status'); // true unless 200 or 429
export const rateLimitHeaders = new Rate('ratelimit_headers'); // RateLimit + RateLimit-Policy present
export const retryAfterHeader = new Rate('retry_after_header'); // 429 carries Retry-After

// A short random [a-z0-9] string, e.g. for a run id.
export function randomId(length = 8) {
  const alphabet = 'abcdefghijklmnopqrstuvwxyz0123456789';
  let out = '';
  for (let i = 0; i < length; i++) out += alphabet[Math.floor(Math.random() * alphabet.length)];
  return out;
}

// The run id: RUN_ID from the environment, or a random one. Call it in setup() (which runs once per
// test) and pass it to the VUs through setup's return value: init code runs once per VU, so a
// random value made there would differ between VUs.
export function runId() {
  return __ENV.RUN_ID || randomId(10);
}

// The API key of one caller: `<plan>_<runId>_<caller>`, e.g. `free_k3x9_17`. The service reads the
// plan from the prefix before the first underscore.
export function apiKey(plan, run, caller) {
  return `${plan}_${run}_${caller}`;
}

// Request parameters for GET /greeting as `key`.
export function greetingParams(key, tags = {}) {
  return {
    headers: { 'X-Api-Key': key },
    tags: Object.assign({ name: 'GET /greeting' }, tags),
  };
}

// A request object for http.batch().
export function greetingRequest(key, tags = {}) {
  return { method: 'GET', url: `${BASE_URL}/greeting`, params: greetingParams(key, tags) };
}

// Looks a response header up case-insensitively (k6 canonicalises names, e.g. `Ratelimit-Policy`).
export function header(res, name) {
  const wanted = name.toLowerCase();
  for (const k of Object.keys(res.headers || {})) {
    if (k.toLowerCase() === wanted) return res.headers[k];
  }
  return undefined;
}

// Records the shared metrics and checks for one response of the limited route. Returns
// { admitted: bool, limited: bool }.
//   opts.checkAdmitted: also run a `status is 200` check (the reference scenario reports it).
export function record(res, tags = {}, opts = {}) {
  const ok = res.status === 200;
  const limited = res.status === 429;
  const expected = ok || limited;
  unexpectedStatus.add(!expected, tags);
  if (expected) admitted.add(ok, tags);

  const checks = { 'status is 200 or 429': (r) => r.status === 200 || r.status === 429 };
  if (opts.checkAdmitted) checks['status is 200'] = (r) => r.status === 200;
  check(res, checks, tags);

  if (expected) {
    const hasHeaders = check(
      res,
      {
        'has RateLimit and RateLimit-Policy headers': (r) =>
          header(r, 'RateLimit') !== undefined && header(r, 'RateLimit-Policy') !== undefined,
      },
      tags,
    );
    rateLimitHeaders.add(hasHeaders, tags);
  }
  if (limited) {
    const hasRetryAfter = check(res, { '429 has Retry-After': (r) => header(r, 'Retry-After') !== undefined }, tags);
    retryAfterHeader.add(hasRetryAfter, tags);
  }
  return { admitted: ok, limited };
}

// One GET /greeting as `key`, recorded. Returns the response.
export function greet(key, tags = {}, opts = {}) {
  const res = http.get(`${BASE_URL}/greeting`, greetingParams(key, tags));
  record(res, tags, opts);
  return res;
}

// Parses a k6 duration string ("30s", "2m", "1m30s", "1h", "500ms"; a bare number means seconds)
// into seconds.
export function durationSeconds(d) {
  const s = String(d).trim();
  if (/^\d+(\.\d+)?$/.test(s)) return Number(s);
  const re = /(\d+(?:\.\d+)?)(ms|s|m|h)/g;
  let total = 0;
  let consumed = 0;
  let m;
  while ((m = re.exec(s)) !== null) {
    const n = Number(m[1]);
    total += m[2] === 'ms' ? n / 1000 : m[2] === 's' ? n : m[2] === 'm' ? n * 60 : n * 3600;
    consumed += m[0].length;
  }
  if (consumed !== s.length || consumed === 0) throw new Error(`cannot parse duration '${d}'`);
  return total;
}

// A k6 duration string for `d` ("30s" for "30s", "45s" for "45").
export function durationString(d) {
  const s = String(d).trim();
  return /^\d+(\.\d+)?$/.test(s) ? `${s}s` : s;
}

// An integer from the environment, or `fallback`.
export function intEnv(name, fallback) {
  const v = __ENV[name];
  if (v === undefined || v === '') return fallback;
  const n = parseInt(v, 10);
  if (!Number.isFinite(n) || n <= 0) throw new Error(`${name} must be a positive integer, got '${v}'`);
  return n;
}

// A positive number from the environment, or `fallback`.
export function numberEnv(name, fallback) {
  const v = __ENV[name];
  if (v === undefined || v === '') return fallback;
  const n = Number(v);
  if (!Number.isFinite(n) || n <= 0) throw new Error(`${name} must be a positive number, got '${v}'`);
  return n;
}

// The share of requests a sliding-window limiter of `limit` per `windowSeconds` admits from one
// caller sending `rps` requests per second, evenly spaced from t=0, for `seconds` seconds. A hold
// made at t is released just after t + window (never before), so a request arriving exactly then
// counts as still inside the window.
export function expectedShare(limit, windowSeconds, rps, seconds) {
  const n = Math.max(1, Math.floor(seconds * rps + 1e-9));
  const holds = [];
  let ok = 0;
  for (let i = 0; i < n; i++) {
    const t = i / rps;
    while (holds.length && holds[0] + windowSeconds < t) holds.shift();
    if (holds.length < limit) {
      holds.push(t);
      ok++;
    }
  }
  return ok / n;
}

// Thresholds for an `admitted` Rate whose expected value is `expected`: a band from 0.6x to 1.5x
// around it (0.10–0.25 for the reference 1/6), or > 0.99 when everything should be admitted. The
// band absorbs timing jitter at window edges and a short run's partial last window.
export function shareThresholds(expected) {
  if (expected >= 0.999) return ['rate>0.99'];
  const lo = 0.6 * expected;
  const hi = Math.min(1.5 * expected, 0.999);
  return [`rate>${lo.toFixed(3)}`, `rate<${hi.toFixed(3)}`];
}
