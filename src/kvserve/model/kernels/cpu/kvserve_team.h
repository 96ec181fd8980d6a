// The thread team of a step on a busy machine (kvserve_team.cpp): how many threads the next step
// uses, and the barrier of the whole-stack forward (kvserve_forward.cpp), which lets a late thread
// leave the step's team between two phases.
#pragma once

#include <stdint.h>

#include <atomic>
#include <vector>

namespace kvs {

// Threads for the next timed forward (nth asked for): the current team, or one more on a probe.
int team_begin(int nth, bool *probe);

// After a timed forward with `used` threads of the `nth` asked for, `kept` of them still in its
// team at the end (fewer: step_team let late ones go): `wait` is the largest share of the step
// any one thread spent waiting at barriers.
void team_end(int nth, int used, int kept, bool probe, double wait);

// The barrier of one forward's parallel region, over the threads still in its team. Every round,
// the last thread to arrive adds each member's wait to a window; when in two windows of at least
// kWindow seconds one after the other some member waited more than kDropWait of the window (the
// step runs at the pace of a thread that is not getting its core), the member that waited least,
// the late one, leaves: from the next phase on it does no work and is not waited for. Its rows,
// tokens and attention items go to the others (`rank`, `size`); the numbers do not change, as
// every kernel's arithmetic for one output is the same for every split. So a long step (a prompt)
// that starts with a core taken, or a probe that finds it still taken, costs a few windows, not
// the whole step. Spins, with sched_yield after a while (the awaited thread may share our core).
struct step_team {
    explicit step_team(int n);
    // Arrive and wait for the team. `me`: omp thread number; adds this thread's wait (TSC ticks) to
    // *waited. False when this thread is not (or no longer) in the team: it must do no more work.
    bool wait(int me, uint64_t *waited);
    // This thread's share of the work: (rank, size) while in the team.
    int rank_of(int me) const { return rank[me]; }
    int size_now() const { return size.load(std::memory_order_relaxed); }
    // Only the first n threads are in the team (OpenMP gave fewer than asked for); before any wait.
    void limit(int n);

  private:
    void round_done(uint64_t now);
    std::atomic<int> arrived{0};
    std::atomic<unsigned> gen{0};
    std::atomic<int> size;
    std::vector<int> rank;            // omp thread -> rank in the team, -1 once it has left
    std::vector<uint64_t> arrive;     // this round's arrival (TSC), per omp thread
    std::vector<uint64_t> waited_win; // the window's waits so far, per omp thread
    uint64_t win_start_tsc = 0;
    double win_start = 0.0;
    int high = 0, rounds = 0;
};

}  // namespace kvs
