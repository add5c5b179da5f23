#!/usr/bin/env python3
"""Latency over time for scripts/sustain: every INTERVAL seconds, reads the service's request
histogram (/metrics/exemplars, OpenMetrics) and the ledger-call histogram (/metrics), and prints one
row per interval with the requests answered in it and their p50 / p99, and the p99 of the ledger's
create_transfers calls: the ledger falling behind shows there before answers fail.

    sustain_timeline.py PORT INTERVAL_SECONDS STOP_FILE

Percentiles come from the histograms' bucket counts in the interval (linear within a bucket), so
they are as coarse as the buckets (0.5, 1, 2.5, 5, 10, 25, 50, 75, 100 ms, ...). Stops when
STOP_FILE exists, after a last, shorter interval that ends when the file was made (none if that
is under a second). Standard library only.
"""
import http.client
import os
import re
import sys
import time
import urllib.request

LINE = re.compile(r'^(\w+)_bucket\{([^}]*)\} ([0-9.e+]+)')
LE = re.compile(r'le="([^"]+)"')


def buckets(url, name, want):
    """Cumulative counts by upper bound, summed over every series of `name` whose labels contain
    all of `want`."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except (OSError, http.client.HTTPException, UnicodeDecodeError):
        # Refused, timed out, or cut short (an overloaded service): unreadable this time.
        return None
    counts = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m or m.group(1) != name or not all(w in m.group(2) for w in want):
            continue
        le = LE.search(m.group(2)).group(1)
        bound = float("inf") if le == "+Inf" else float(le)
        counts[bound] = counts.get(bound, 0.0) + float(m.group(3).split(" ")[0])
    return counts


def percentile(before, after, q):
    bounds = sorted(after)
    deltas = [after[b] - before.get(b, 0.0) for b in bounds]
    total = deltas[-1] if deltas else 0.0
    if total <= 0:
        return None, 0
    target = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, deltas):
        if cumulative >= target:
            if bound == float("inf"):
                return lower * 1000, int(total)
            share = (target - below) / max(cumulative - below, 1e-9)
            return (lower + (bound - lower) * share) * 1000, int(total)
        lower, below = bound, cumulative
    return lower * 1000, int(total)


def main():
    port, interval, stop_file = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    base = f"http://127.0.0.1:{port}"
    requests = (f"{base}/metrics/exemplars", "http_server_request_duration_seconds",
                ['route="/greeting"'])
    ledger = (f"{base}/metrics", "ledger_limiter_ledger_call_duration_seconds",
              ['operation="create_transfers"'])
    print("| s | answered/s | p50 ms | p99 ms | ledger create_transfers p99 ms |", flush=True)
    print("|--:|--:|--:|--:|--:|", flush=True)
    parent = os.getppid()
    # The first interval's baseline: read, not assumed empty (the service's counts include
    # every earlier step's), bounded by 10 tries.
    last = (None, None)
    for _ in range(10):
        last = (buckets(*requests), buckets(*ledger))
        if last[0] is not None and last[1] is not None:
            break
        time.sleep(0.5)
    else:
        sys.exit("no baseline read of the service's histograms")
    start = time.monotonic()
    last_at = start
    stopped = False
    last_tries = 10  # reads of the last interval, once stopped: it is not dropped for one failure
    while not stopped or last_tries > 0:
        due = last_at + interval
        while time.monotonic() < due and not stopped:
            time.sleep(0.5)
            stopped = os.path.exists(stop_file)
            # scripts/sustain gone (killed: no trap ran, no stop file comes): end with it.
            if os.getppid() != parent:
                sys.exit(1)
        now = (buckets(*requests), buckets(*ledger))
        at = time.monotonic()
        if now[0] is None or now[1] is None:
            # Unreadable (the service busy or gone): try again in a while, not in a tight loop.
            last_tries -= stopped
            time.sleep(0.5)
            continue
        if stopped:
            # The step ended when the stop file was made (right after k6 exits): the last
            # interval ends there, not at this read, or its idle tail would lower its rate.
            at = min(at, at - (time.time() - os.path.getmtime(stop_file)))
            if at - last_at < 1:
                break
        p50, n = percentile(last[0], now[0], 0.50)
        p99, _ = percentile(last[0], now[0], 0.99)
        l99, _ = percentile(last[1], now[1], 0.99)
        fmt = lambda v: "–" if v is None else f"{v:.1f}"
        rate = n / max(at - last_at, 1e-3)
        print(f"| {at - start:.0f} | {rate:.0f} | {fmt(p50)} | {fmt(p99)} | {fmt(l99)} |", flush=True)
        last, last_at = now, at
        if stopped:
            break

if __name__ == "__main__":
    main()
