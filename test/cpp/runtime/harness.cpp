#include "harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace monarch::testing {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    throw std::runtime_error("bind() failed");
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string worker_scenario() {
  const char* s = std::getenv("MONARCH_TEST_SCENARIO");
  return s ? s : "";
}

std::string worker_output_dir() {
  const char* s = std::getenv("MONARCH_TEST_OUTPUT");
  return s ? s : ".";
}

bool LaunchResult::all_ok() const {
  if (timed_out) return false;
  for (const auto& r : ranks) {
    if (r.exit_code != 0) return false;
  }
  return true;
}

std::string LaunchResult::describe() const {
  std::ostringstream out;
  if (timed_out) out << "timed out; ";
  for (size_t r = 0; r < ranks.size(); ++r) {
    const std::string& e = ranks[r].stderr_text;
    out << "\n[rank " << r << " exit " << ranks[r].exit_code << "] "
        << (e.size() > 1500 ? e.substr(e.size() - 1500) : e);
  }
  return out.str();
}

LaunchResult launch_ranks(int world_size, const std::string& scenario, std::chrono::seconds timeout,
                          const std::map<std::string, std::string>& extra_env) {
  char dir_template[] = "/tmp/monarch-test-XXXXXX";
  const char* dir = ::mkdtemp(dir_template);
  if (dir == nullptr) throw std::runtime_error("mkdtemp failed");
  LaunchResult result;
  result.output_dir = dir;
  const int port = free_port();
  std::vector<pid_t> pids;
  // Everything the child needs is prepared before fork(): between fork and exec the child
  // only makes async-signal-safe calls (the parent may have torch's threads running).
  for (int r = 0; r < world_size; ++r) {
    std::map<std::string, std::string> vars;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      const auto eq = kv.find('=');
      if (eq != std::string::npos) vars[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    vars["MASTER_ADDR"] = "127.0.0.1";
    vars["MASTER_PORT"] = std::to_string(port);
    vars["RANK"] = vars["LOCAL_RANK"] = std::to_string(r);
    vars["WORLD_SIZE"] = vars["LOCAL_WORLD_SIZE"] = std::to_string(world_size);
    vars["MONARCH_TEST_SCENARIO"] = scenario;
    vars["MONARCH_TEST_OUTPUT"] = result.output_dir;
    vars["OMP_NUM_THREADS"] = "1";
    for (const auto& [k, v] : extra_env) vars[k] = v;
    std::vector<std::string> strings;
    for (const auto& [k, v] : vars) strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& str : strings) envp.push_back(str.data());
    envp.push_back(nullptr);
    const std::string err_path = result.output_dir + "/rank" + std::to_string(r) + ".stderr";
    char exe[] = "/proc/self/exe";
    char* argv[] = {exe, nullptr};

    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int null = ::open("/dev/null", O_WRONLY);
      if (err < 0 || null < 0) ::_exit(97);
      ::dup2(err, 2);
      ::dup2(null, 1);
      ::execve(exe, argv, envp.data());
      ::_exit(98);
    }
    pids.push_back(pid);
  }
  result.ranks.resize(world_size);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  size_t remaining = pids.size();
  std::vector<bool> done(pids.size(), false);
  while (remaining > 0) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (done[r]) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
        --remaining;
        result.ranks[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      result.timed_out = true;
      for (size_t r = 0; r < pids.size(); ++r) {
        if (!done[r]) {
          ::kill(pids[r], SIGKILL);
          ::waitpid(pids[r], nullptr, 0);
          result.ranks[r].exit_code = -1;
        }
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world_size; ++r) {
    std::ifstream in(result.output_dir + "/rank" + std::to_string(r) + ".stderr");
    std::stringstream ss;
    ss << in.rdbuf();
    result.ranks[r].stderr_text = ss.str();
  }
  return result;
}

}  // namespace monarch::testing
