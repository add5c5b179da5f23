// Sustained load at a fixed arrival rate (an open model: when the service slows down, requests
// queue and their latency shows it, instead of the sender slowing down with it). Every request is
// admitted (a plan far above the offered load), so every one is a durable hold in the ledger, and
// with a 60 s window the holds expire as fast as they are made once the first minute has passed.
//
//   RATE=2000 DURATION=10m BASE_URL=http://127.0.0.1:8080 k6 run k6/sustain.js
//
// Run by scripts/sustain, which steps RATE up and records the ledger's side. Environment: BASE_URL,
// RATE (requests/s, default 1000), DURATION (default 10m), CALLERS (distinct keys, round-robin,
// default 10000), KEY_PREFIX (default "sustain_").

import http from 'k6/http';
import exec from 'k6/execution';
import { durationSeconds } from './lib/common.js';

const BASE_URL = (__ENV.BASE_URL || 'http://127.0.0.1:8080').replace(/\/+$/, '');
const RATE = parseInt(__ENV.RATE || '1000', 10);
const CALLERS = parseInt(__ENV.CALLERS || '10000', 10);
const PREFIX = __ENV.KEY_PREFIX || 'sustain_';
const DURATION = __ENV.DURATION || '10m';
const SECONDS = durationSeconds(DURATION); // "10m", "90s", "1m30s", "1h"...
// k6 itself drops a few iterations while it starts VUs: up to 0.1% of the offered requests is
// k6, more is the service not keeping up.
const DROPPED_MAX = Math.ceil(RATE * SECONDS * 0.001);

http.setResponseCallback(http.expectedStatuses(200));

export const options = {
  discardResponseBodies: true,
  summaryTrendStats: ['avg', 'p(50)', 'p(90)', 'p(99)', 'max'],
  // The stop criteria of scripts/sustain: a rate is sustained only if all three hold.
  thresholds: {
    http_req_duration: ['p(99)<50'],
    http_req_failed: ['rate==0'],
    dropped_iterations: [`count<=${DROPPED_MAX}`],
  },
  scenarios: {
    sustain: {
      executor: 'constant-arrival-rate',
      rate: RATE,
      timeUnit: '1s',
      duration: DURATION,
      // Enough VUs for every request of a quarter second in flight, and room for the deadline.
      preAllocatedVUs: Math.max(32, Math.ceil(RATE * 0.25)),
      maxVUs: Math.max(128, RATE),
    },
  },
};

export default function () {
  const n = exec.scenario.iterationInTest % CALLERS;
  http.get(`${BASE_URL}/greeting`, { headers: { 'X-Api-Key': `${PREFIX}${n}` } });
}
