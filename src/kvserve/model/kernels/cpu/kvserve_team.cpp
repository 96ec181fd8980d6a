// The team size on a busy machine.
//
// Every step's parallel region separates its phases by barriers, so a step runs at the pace of its
// slowest thread. When another process holds one of the cores, the thread sharing that core gets
// it in slices of a few milliseconds, and each of the ~300 barriers of a decode step waits for it:
// on 2 cores with one busy, 2 threads kept 26% of the quiet decode speed where 1 thread alone,
// on the free core, keeps about two thirds. So the forward times the barriers: if in two steps
// running one after the other some thread waited for the others more than kDropWait of the step
// (a static split of even work waits ~0-15% on a quiet machine), the next steps run with one thread
// fewer; and now and then (kProbeMin, doubling to kProbeMax while the probes keep failing) one
// step runs with one thread more, which is kept if its threads waited less than kKeepWait.
// The other parallel calls (the LM head, the per-layer glue) run with the same count.
//
// Inside one step the same rule runs over windows of kWindow seconds (step_team): a prompt's
// forward is one step of up to seconds, so a step that starts with the full team on a machine that
// has just become busy (or a probe that finds the core still taken) lets its late thread go after
// two windows instead of running the whole step at the late thread's pace.
//
// Answers do not change: every kernel's arithmetic for one output is the same for every split of
// its rows, tokens or attention items over threads (kvserve_kernels.cpp, attend_tiles).

#include "kvserve_team.h"

#include <immintrin.h>
#include <sched.h>
#include <time.h>
#include <x86intrin.h>

#include "kvserve_kernels.h"

namespace {

constexpr double kDropWait = 0.45, kKeepWait = 0.30;
constexpr double kProbeMin = 0.25, kProbeMax = 2.0;   // seconds between probes
constexpr double kWindow = 0.02;                      // seconds: step_team's windows
constexpr int kSpinsBeforeYield = 4096;

struct team_state {
    std::atomic<int> team{0};      // threads to use now; 0 = as many as asked for
    std::atomic<int> adaptive{1};
    std::atomic<int> shed_at{0};   // tests: every forward lets a thread go after this many rounds
    int high = 0;                  // consecutive steps whose wait was above kDropWait
    double next_probe = 0.0, gap = kProbeMin;
    double last_wait = 0.0;
    long steps = 0, reduced_steps = 0, drops = 0, probes = 0, recoveries = 0, sheds = 0;
};
team_state g_team;

double now_s() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

}  // namespace

namespace kvs {

int team_begin(int nth, bool *probe) {
    *probe = false;
    const int t = g_team.team.load(std::memory_order_relaxed);
    if (!g_team.adaptive.load(std::memory_order_relaxed) || t <= 0 || t >= nth) return nth;
    if (now_s() >= g_team.next_probe) {
        *probe = true;
        g_team.probes++;
        return t + 1;
    }
    return t;
}

void team_end(int nth, int used, int kept, bool probe, double wait) {
    team_state &s = g_team;
    s.steps++;
    if (used < nth) s.reduced_steps++;
    if (used < 2) return;
    s.last_wait = wait;
    if (kept < used) {    // late threads left inside the step: its end says so for the next steps
        s.team.store(kept, std::memory_order_relaxed);
        s.drops++;
        s.high = 0;
        if (probe) s.gap = s.gap * 2 < kProbeMax ? s.gap * 2 : kProbeMax;
        s.next_probe = now_s() + s.gap;
        return;
    }
    if (probe) {
        if (wait < kKeepWait) {
            s.team.store(used >= nth ? 0 : used, std::memory_order_relaxed);
            s.gap = kProbeMin;
            s.recoveries++;
        } else {
            s.gap = s.gap * 2 < kProbeMax ? s.gap * 2 : kProbeMax;
        }
        s.next_probe = now_s() + s.gap;
        s.high = 0;
        return;
    }
    if (!s.adaptive.load(std::memory_order_relaxed)) return;
    s.high = wait > kDropWait ? s.high + 1 : 0;
    if (s.high >= 2) {
        s.team.store(used - 1, std::memory_order_relaxed);
        s.drops++;
        s.high = 0;
        s.next_probe = now_s() + s.gap;
    }
}

int team_for(int nth) {
    const int t = g_team.team.load(std::memory_order_relaxed);
    if (!g_team.adaptive.load(std::memory_order_relaxed) || t <= 0 || t >= nth) return nth < 1 ? 1 : nth;
    return t;
}

step_team::step_team(int n) : size(n), rank(n), arrive(n, 0), waited_win(n, 0) {
    for (int i = 0; i < n; i++) rank[i] = i;
    win_start_tsc = __rdtsc();
    win_start = now_s();
}

void step_team::limit(int n) {
    for (int i = n; i < (int)rank.size(); i++) rank[i] = -1;
    size.store(n, std::memory_order_relaxed);
}

bool step_team::wait(int me, uint64_t *waited) {
    if (rank[me] < 0) return false;
    const uint64_t t0 = __rdtsc();
    arrive[me] = t0;
    const unsigned g = gen.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == size.load(std::memory_order_relaxed)) {
        round_done(t0);
        arrived.store(0, std::memory_order_relaxed);
        gen.store(g + 1, std::memory_order_release);
    } else {
        for (int spins = 0; gen.load(std::memory_order_acquire) == g;) {
            _mm_pause();
            if (++spins > kSpinsBeforeYield) sched_yield();
        }
    }
    *waited += __rdtsc() - t0;
    return rank[me] >= 0;
}

// Run by the round's last thread while the others wait: the window's bookkeeping and the rule.
void step_team::round_done(uint64_t now) {
    const int n = (int)rank.size();
    for (int i = 0; i < n; i++)
        if (rank[i] >= 0) waited_win[i] += now - arrive[i];
    rounds++;
    const int forced = g_team.shed_at.load(std::memory_order_relaxed);
    bool shed = forced > 0 && rounds == forced;
    if (!forced) {
        const double t = now_s();
        if (t - win_start < kWindow) return;
        uint64_t most = 0;
        for (int i = 0; i < n; i++)
            if (rank[i] >= 0 && waited_win[i] > most) most = waited_win[i];
        const double share = now > win_start_tsc ? (double)most / (double)(now - win_start_tsc) : 0.0;
        high = share > kDropWait ? high + 1 : 0;
        shed = high >= 2 && g_team.adaptive.load(std::memory_order_relaxed);
        win_start = t;
    }
    if (shed && size.load(std::memory_order_relaxed) > 1) {
        int late = -1;
        for (int i = 0; i < n; i++)
            if (rank[i] >= 0 && (late < 0 || waited_win[i] < waited_win[late])) late = i;
        rank[late] = -1;
        for (int i = 0, r = 0; i < n; i++)
            if (rank[i] >= 0) rank[i] = r++;
        size.store(size.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed);
        g_team.sheds++;
        high = 0;
    }
    win_start_tsc = now;
    for (int i = 0; i < n; i++) waited_win[i] = 0;
}

}  // namespace kvs

extern "C" {

// 0: always the full count (KVSERVE_ADAPTIVE_THREADS=0); 1: fewer threads while a core is taken.
void kvs_set_adaptive_threads(int on) {
    g_team.adaptive.store(on ? 1 : 0);
    if (!on) g_team.team.store(0);
}

// Threads the parallel calls use now (0: as many as asked for).
int kvs_team_threads(void) { return g_team.team.load(); }

// out[9]: steps, steps with fewer threads, drops, probes, recoveries, last measured wait share,
// current team (0 = full), seconds to the next probe, threads that left a step's team inside it.
void kvs_team_stats(double *out) {
    const team_state &s = g_team;
    out[0] = s.steps, out[1] = s.reduced_steps, out[2] = s.drops, out[3] = s.probes, out[4] = s.recoveries;
    out[5] = s.last_wait, out[6] = s.team.load(), out[7] = s.next_probe - now_s(), out[8] = s.sheds;
}

// Set the team now (tests, diagnostics): n threads (0 = as many as asked for), until the next
// drop or probe changes it.
void kvs_team_force(int n) { g_team.team.store(n < 0 ? 0 : n); }

// Tests: every forward with more than one thread lets one go after `rounds` barriers (0: the rule).
void kvs_team_shed_at(int rounds) { g_team.shed_at.store(rounds < 0 ? 0 : rounds); }

// Forget what was learnt (tests, benchmarks' phases): the full team again.
void kvs_team_reset(void) {
    team_state &s = g_team;
    s.team.store(0);
    s.high = 0, s.next_probe = 0.0, s.gap = kProbeMin, s.last_wait = 0.0;
    s.steps = s.reduced_steps = s.drops = s.probes = s.recoveries = s.sheds = 0;
}

}  // extern "C"
