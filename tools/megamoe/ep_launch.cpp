// run_ep_ranks (ep_launch.h): posix_spawn of the ranks and the wait for them.
#include "tools/megamoe/ep_launch.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "megamoe/status.h"

namespace megamoe::tool {

std::vector<std::string> ep_rank_environment(const char* const* parent) {
  static const char* const kForced[][2] = {{"NCCL_NVLS_ENABLE", "0"},
                                           {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"},
                                           {"NVSHMEM_DISABLE_NVLS", "1"}};
  std::vector<std::string> env;
  for (const char* const* e = parent; e != nullptr && *e != nullptr; ++e) {
    const std::string kv = *e;
    bool forced = false;
    for (const auto& f : kForced) forced = forced || kv.rfind(std::string(f[0]) + "=", 0) == 0;
    if (!forced) env.push_back(kv);
  }
  // Never NVLink multicast, in the ranks and in anything they start.
  for (const auto& f : kForced) env.push_back(std::string(f[0]) + "=" + f[1]);
  return env;
}

namespace {

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "status " + std::to_string(status);
}

void signal_all(const std::vector<pid_t>& pids, int sig) {
  for (pid_t p : pids)
    if (p > 0) kill(p, sig);
}

}  // namespace

void run_ep_ranks(const EpRankLaunch& launch) {
  const int R = launch.world_size;
  MEGAMOE_CHECK(R >= 1 && R <= 8, kInvalidArgument, launch.command, ": the world size ", R, " must be 1..8");
  MEGAMOE_CHECK(static_cast<bool>(launch.rank_argv), kInternal, launch.command, ": no rank arguments");
  std::vector<std::string> env_strings = ep_rank_environment(::environ);  // unistd.h (_GNU_SOURCE)
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);

  std::vector<pid_t> pids;  // by rank; 0 once reaped
  for (int r = 0; r < R; ++r) {
    std::vector<std::string> argv_s = launch.rank_argv(r);
    MEGAMOE_CHECK(!argv_s.empty(), kInternal, launch.command, ": empty argument vector for rank ", r);
    std::vector<char*> argv;
    for (std::string& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, launch.executable.c_str(), nullptr, nullptr, argv.data(), envp.data());
    if (rc != 0) {
      // The ranks already started would wait for this one until their timeout: end them now.
      signal_all(pids, SIGTERM);
      for (pid_t started : pids) {
        while (waitpid(started, nullptr, 0) < 0 && errno == EINTR) {
        }
      }
      MEGAMOE_FAIL(kIo, launch.command, ": could not start rank ", r, " (posix_spawn of ", launch.executable, ": ",
                   std::strerror(rc), ")");
    }
    pids.push_back(pid);
  }

  // Poll our own children only (waitpid(-1) would also reap children this process started for
  // other reasons), every few milliseconds: that also lets a deadline end the run.
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  int failed = -1, failed_status = 0;
  bool deadline_passed = false;
  Clock::time_point terminated_at{};
  bool killed = false;
  for (size_t left = pids.size(); left > 0;) {
    bool reaped = false;
    for (size_t r = 0; r < pids.size(); ++r) {
      if (pids[r] <= 0) continue;
      int status = 0;
      const pid_t got = waitpid(pids[r], &status, WNOHANG);
      if (got == 0 || (got < 0 && errno == EINTR)) continue;
      MEGAMOE_CHECK(got == pids[r], kInternal, launch.command, ": waitpid for rank ", r,
                    " failed: ", std::strerror(errno));
      pids[r] = 0;
      --left;
      reaped = true;
      if ((!WIFEXITED(status) || WEXITSTATUS(status) != 0) && failed < 0 && !deadline_passed) {
        failed = static_cast<int>(r);
        failed_status = status;
        // The others would wait for it at a barrier until their timeout.
        signal_all(pids, SIGTERM);
        terminated_at = Clock::now();
      }
    }
    if (left == 0) break;
    if (!deadline_passed && failed < 0 && launch.deadline_seconds > 0 && seconds_since(start) > launch.deadline_seconds) {
      deadline_passed = true;
      signal_all(pids, SIGTERM);
      terminated_at = Clock::now();
    }
    // A rank that ignores SIGTERM for 10 s (stuck in the driver) is killed.
    if ((failed >= 0 || deadline_passed) && !killed && seconds_since(terminated_at) > 10.0) {
      signal_all(pids, SIGKILL);
      killed = true;
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  MEGAMOE_CHECK(!deadline_passed, kInternal, launch.command, ": the ranks did not finish within ",
                launch.deadline_seconds, " s; all were ended");
  MEGAMOE_CHECK(failed < 0, kInternal, launch.command, ": rank ", failed, " failed (", describe_status(failed_status),
                "); its message is above");
}

}  // namespace megamoe::tool
