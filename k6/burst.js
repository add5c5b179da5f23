// Burst scenario: exact admission under concurrency, then credit coming back after the window.
//
// One VU, one iteration, explicit phases, two callers:
//   basic caller (capacity 50 per 30 s)          free caller (capacity 5 per 30 s)
//   phase 1: 50 at once -> exactly 50 admitted    10 at once -> exactly 5 admitted, 5 limited
//   phase 2: 50 at once -> exactly 50 limited      5 at once -> exactly 5 limited
//   wait until 30 s + 2 s after phase 1 answered (every hold has expired)
//   phase 3: 50 at once -> exactly 50 admitted     6 at once -> exactly 5 admitted, 1 limited
//
// Counts have a tolerance of 0 (Counter thresholds `count==N`): the ledger is linearizable, so a
// concurrent burst at capacity must be admitted in full and one unit more must be refused.
//
// Environment: BASE_URL, RUN_ID (see lib/common.js). Takes about 35 s.

import http from 'k6/http';
import { check, sleep } from 'k6';
import { Counter, Rate } from 'k6/metrics';
import { PLANS, apiKey, greetingRequest, header, record, runId } from './lib/common.js';

const WAIT_SECONDS = Math.max(PLANS.basic.windowSeconds, PLANS.free.windowSeconds) + 2;

// Counters per caller and phase; every response adds 0 or 1 to both of its phase's counters, so
// each counter has samples and `count==0` is meaningful.
const counters = {};
const thresholds = {
  unexpected_status: ['rate==0'],
  ratelimit_headers: ['rate>0.99'],
  retry_after_header: ['rate==1'],
  retry_after_in_window: ['rate==1'],
};
// Every phase-2 429's Retry-After is a whole number of seconds within the window: a check alone
// would only be reported, this fails the run.
const retryAfterInWindow = new Rate('retry_after_in_window');
const EXPECT = {
  basic: { 1: [50, 0], 2: [0, 50], 3: [50, 0] },
  free: { 1: [5, 5], 2: [0, 5], 3: [5, 1] },
};
for (const who of Object.keys(EXPECT)) {
  for (const phase of [1, 2, 3]) {
    const prefix = who === 'basic' ? '' : `${who}_`; // basic: admitted_phase1, free: free_admitted_phase1
    const a = `${prefix}admitted_phase${phase}`;
    const l = `${prefix}limited_phase${phase}`;
    counters[a] = new Counter(a);
    counters[l] = new Counter(l);
    thresholds[a] = [`count==${EXPECT[who][phase][0]}`];
    thresholds[l] = [`count==${EXPECT[who][phase][1]}`];
  }
}

export const options = {
  discardResponseBodies: true,
  // http.batch() sends at most `batchPerHost` requests to one host at a time (default 6).
  batch: 100,
  batchPerHost: 100,
  scenarios: {
    burst: { executor: 'per-vu-iterations', vus: 1, iterations: 1, maxDuration: '2m' },
  },
  thresholds,
  summaryTrendStats: ['avg', 'min', 'med', 'p(90)', 'p(95)', 'p(99)', 'max'],
};

export function setup() {
  const run = runId();
  console.log(`run id ${run}`);
  return { run };
}

function burst(who, key, phase, n) {
  const tags = { plan: who, phase: String(phase) };
  const responses = http.batch(Array.from({ length: n }, () => greetingRequest(key, tags)));
  let ok = 0;
  let limited = 0;
  for (const res of responses) {
    const r = record(res, tags);
    counters[`${who === 'basic' ? '' : `${who}_`}admitted_phase${phase}`].add(r.admitted ? 1 : 0, tags);
    counters[`${who === 'basic' ? '' : `${who}_`}limited_phase${phase}`].add(r.limited ? 1 : 0, tags);
    if (r.admitted) ok++;
    if (r.limited) limited++;
  }
  return { ok, limited, responses };
}

export default function (data) {
  const basicKey = apiKey('basic', data.run, 'burst');
  const freeKey = apiKey('free', data.run, 'burst');

  // Phase 1: bursts exactly at (basic) and twice (free) the capacity.
  const p1 = [burst('basic', basicKey, 1, 50), burst('free', freeKey, 1, 10)];
  const phase1Done = Date.now();
  console.log(`phase 1: basic ${p1[0].ok} admitted / ${p1[0].limited} limited; free ${p1[1].ok} / ${p1[1].limited}`);

  // Phase 2: both callers are exhausted; every 429 says when to come back.
  const p2 = [burst('basic', basicKey, 2, 50), burst('free', freeKey, 2, 5)];
  console.log(`phase 2: basic ${p2[0].ok} admitted / ${p2[0].limited} limited; free ${p2[1].ok} / ${p2[1].limited}`);
  for (const { responses } of p2) {
    for (const res of responses) {
      if (res.status !== 429) continue;
      const v = Number(header(res, 'Retry-After'));
      const inWindow = Number.isInteger(v) && v >= 1 && v <= WAIT_SECONDS;
      retryAfterInWindow.add(inWindow);
      check(res, { 'Retry-After is 1..window seconds': () => inWindow });
    }
  }

  // Wait out the window: every hold from phase 1 expires 30 s after it was made (phase 2 made none).
  const waitMs = WAIT_SECONDS * 1000 - (Date.now() - phase1Done);
  if (waitMs > 0) sleep(waitMs / 1000);

  // Phase 3: the credit is back in full.
  const p3 = [burst('basic', basicKey, 3, 50), burst('free', freeKey, 3, 6)];
  console.log(`phase 3: basic ${p3[0].ok} admitted / ${p3[0].limited} limited; free ${p3[1].ok} / ${p3[1].limited}`);
}
