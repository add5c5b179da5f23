// Many callers on mixed plans, each at a steady rate (constant arrival rate, so the service's
// latency does not change the offered load). Every group is one scenario; within a group the
// iterations go round-robin over the group's callers, so each caller sends exactly `rps` requests
// per second.
//
//   group        plan   callers  rps each  per 30 s vs limit   expected admitted (30 s run)
//   free_over    free     100      1         30 vs 5            5/30  = 16.7%
//   basic_under  basic     40      1         30 vs 50           100%
//   basic_over   basic     20      3         90 vs 50           50/90 = 55.6%
//   pro_under    pro       40      1         30 vs 500          100%
//
// 200 callers, 240 requests/s in all. Thresholds are per group on the `admitted` Rate (sub-metrics
// by the automatic `scenario` tag); every sample is also tagged with `plan`.
//
// Environment: BASE_URL, RUN_ID (see lib/common.js), DURATION (default 30s), SCALE (multiplies the
// number of callers in every group, default 1; e.g. SCALE=0.25 for a smoke run).

import exec from 'k6/execution';
import {
  PLANS,
  apiKey,
  durationSeconds,
  durationString,
  expectedShare,
  greet,
  numberEnv,
  runId,
  shareThresholds,
} from './lib/common.js';

const DURATION = durationString(__ENV.DURATION || '30s');
const SCALE = numberEnv('SCALE', 1);

const GROUPS = [
  { name: 'free_over', plan: 'free', callers: 100, rps: 1 },
  { name: 'basic_under', plan: 'basic', callers: 40, rps: 1 },
  { name: 'basic_over', plan: 'basic', callers: 20, rps: 3 },
  { name: 'pro_under', plan: 'pro', callers: 40, rps: 1 },
].map((g) => {
  const callers = Math.max(1, Math.round(g.callers * SCALE));
  const plan = PLANS[g.plan];
  const expected = expectedShare(plan.limit, plan.windowSeconds, g.rps, durationSeconds(DURATION));
  return Object.assign({}, g, { callers, expected });
});

const BY_NAME = {};
for (const g of GROUPS) BY_NAME[g.name] = g;

const scenarios = {};
const thresholds = {
  unexpected_status: ['rate<0.01'],
  ratelimit_headers: ['rate>0.99'],
  retry_after_header: ['rate>0.99'],
};
for (const g of GROUPS) {
  const rate = g.callers * g.rps;
  scenarios[g.name] = {
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
  thresholds[`admitted{scenario:${g.name}}`] = shareThresholds(g.expected);
}

export const options = {
  discardResponseBodies: true,
  scenarios,
  thresholds,
  summaryTrendStats: ['avg', 'min', 'med', 'p(90)', 'p(95)', 'p(99)', 'max'],
};

export function setup() {
  const run = runId();
  const plan = GROUPS.map((g) => `${g.name}: ${g.callers} x ${g.rps}/s, ~${(g.expected * 100).toFixed(1)}% admitted`);
  console.log(`run id ${run}; ${plan.join('; ')}`);
  return { run };
}

export function caller(data) {
  const g = BY_NAME[exec.scenario.name];
  const n = exec.scenario.iterationInTest % g.callers;
  // e.g. basic_<run>_over7: the plan prefix first, then a caller name unique within the run.
  const caller = `${g.name.slice(g.plan.length + 1)}${n}`;
  greet(apiKey(g.plan, data.run, caller), { plan: g.plan });
}
