// Short soak: ~20 callers at a steady rate inside their limits for a while. Nothing should be
// limited, nothing should fail, and the service should stay fast.
//
//   group   plan   callers  rps each  per 30 s vs limit
//   basic   basic     10      1         30 vs 50
//   pro     pro       10      5        150 vs 500
//
// 60 requests/s in all. Thresholds: admitted > 99%, p99 latency < 50 ms, no unexpected statuses.
//
// Environment: BASE_URL, RUN_ID (see lib/common.js), DURATION (default 2m).

import exec from 'k6/execution';
import { apiKey, durationString, greet, runId } from './lib/common.js';

const DURATION = durationString(__ENV.DURATION || '2m');

const GROUPS = {
  soak_basic: { plan: 'basic', callers: 10, rps: 1 },
  soak_pro: { plan: 'pro', callers: 10, rps: 5 },
};

const scenarios = {};
for (const [name, g] of Object.entries(GROUPS)) {
  const rate = g.callers * g.rps;
  scenarios[name] = {
    executor: 'constant-arrival-rate',
    exec: 'caller',
    rate,
    timeUnit: '1s',
    duration: DURATION,
    preAllocatedVUs: Math.max(2, Math.ceil(rate / 20)),
    maxVUs: Math.max(10, rate),
    gracefulStop: '5s',
    tags: { plan: g.plan },
  };
}

export const options = {
  discardResponseBodies: true,
  scenarios,
  thresholds: {
    admitted: ['rate>0.99'],
    unexpected_status: ['rate==0'],
    http_req_failed: ['rate==0'],
    'http_req_duration{name:GET /greeting}': ['p(99)<50'],
    ratelimit_headers: ['rate>0.99'],
  },
  summaryTrendStats: ['avg', 'min', 'med', 'p(90)', 'p(95)', 'p(99)', 'max'],
};

export function setup() {
  const run = runId();
  console.log(`run id ${run}`);
  return { run };
}

export function caller(data) {
  const g = GROUPS[exec.scenario.name];
  const n = exec.scenario.iterationInTest % g.callers;
  greet(apiKey(g.plan, data.run, `soak${n}`), { plan: g.plan });
}
