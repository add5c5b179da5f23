// Reference scenario: 100 callers (one per VU), each sending GET /greeting once a second for 30 s,
// all on the `free` plan (5 requests per 30 s sliding window). Each caller gets 5 of its ~30
// requests admitted, so about 1/6 (16.7%) of all requests are admitted.
//
//   k6 run k6/reference.js
//   BASE_URL=http://127.0.0.1:8080 VUS=10 DURATION=10s k6 run k6/reference.js   # smoke run
//
// Environment: BASE_URL, RUN_ID (see lib/common.js), VUS (default 100), DURATION (default 30s).
// The `admitted` band follows the duration (0.10–0.25 at 30 s; at 10 s a caller is admitted 5 of
// 10 times, so the band is 0.30–0.75).

import { sleep } from 'k6';
import {
  PLANS,
  apiKey,
  durationSeconds,
  durationString,
  expectedShare,
  greet,
  intEnv,
  runId,
  shareThresholds,
} from './lib/common.js';

const VUS = intEnv('VUS', 100);
const DURATION = durationString(__ENV.DURATION || '30s');
const PLAN = 'free';
const EXPECTED = expectedShare(PLANS[PLAN].limit, PLANS[PLAN].windowSeconds, 1, durationSeconds(DURATION));

export const options = {
  discardResponseBodies: true,
  scenarios: {
    reference: {
      executor: 'constant-vus',
      vus: VUS,
      duration: DURATION,
      gracefulStop: '5s',
      tags: { plan: PLAN },
    },
  },
  thresholds: {
    admitted: shareThresholds(EXPECTED),
    unexpected_status: ['rate<0.01'],
    ratelimit_headers: ['rate>0.99'],
    retry_after_header: ['rate>0.99'],
  },
  summaryTrendStats: ['avg', 'min', 'med', 'p(90)', 'p(95)', 'p(99)', 'max'],
};

export function setup() {
  const run = runId();
  console.log(`run id ${run}; expecting ${(EXPECTED * 100).toFixed(1)}% admitted`);
  return { run };
}

export default function (data) {
  greet(apiKey(PLAN, data.run, __VU), { plan: PLAN }, { checkAdmitted: true });
  sleep(1);
}
