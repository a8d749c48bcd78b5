// The emulator's runtime: runs a launch block by block, each block's threads as cooperative
// fibers that switch only at barriers and warp operations, and reports what a GPU would leave
// undefined (docs/cuda_emulation.md). Not instrumented itself; the kernel files are compiled
// with -fsanitize=thread so that every load and store of theirs calls the __tsan_* hooks at the
// end of this file, which feed the shared-memory race detector.
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cuda_emu.h"

#if !defined(__x86_64__) || defined(QCA_EMU_UCONTEXT)
#include <ucontext.h>
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace qca_emu {
namespace {

// ---------------------------------------------------------------------------------------------
// Fibers. On x86-64 a switch saves the callee-saved registers and the FPU/SSE control words on
// the old stack and pops them from the new one (no system call, unlike swapcontext's signal-mask
// save and restore); elsewhere ucontext.

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;

#if defined(__x86_64__) && !defined(QCA_EMU_UCONTEXT)
extern "C" void qca_emu_switch(void** save_sp, void* load_sp);
extern "C" void qca_emu_fiber_start();
asm(R"(
  .text
  .globl qca_emu_switch
  .hidden qca_emu_switch
  .type qca_emu_switch, @function
qca_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  fnstcw (%rsp)
  stmxcsr 8(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size qca_emu_switch, .-qca_emu_switch

  .globl qca_emu_fiber_start
  .hidden qca_emu_fiber_start
  .type qca_emu_fiber_start, @function
qca_emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size qca_emu_fiber_start, .-qca_emu_fiber_start
)");

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest usable byte; kStackBytes long

  // The next switch to this fiber calls entry(arg) on a fresh stack.
  void prepare(void (*entry)(void*), void* arg) {
    uint64_t* top = reinterpret_cast<uint64_t*>(stack + kStackBytes);  // 16-byte aligned
    // From the top: a spare slot, the return address (so that qca_emu_fiber_start begins with
    // the stack aligned as after a call), rbp, rbx, r12 = arg, r13 = entry, r14, r15, then the
    // control words (x87 0x37f, MXCSR 0x1f80: the defaults).
    uint64_t* frame = top - 11;
    frame[0] = 0x37f;
    frame[1] = 0x1f80;
    frame[2] = 0;                                           // r15
    frame[3] = 0;                                           // r14
    frame[4] = reinterpret_cast<uint64_t>(entry);           // r13
    frame[5] = reinterpret_cast<uint64_t>(arg);             // r12
    frame[6] = 0;                                           // rbx
    frame[7] = 0;                                           // rbp
    frame[8] = reinterpret_cast<uint64_t>(&qca_emu_fiber_start);
    frame[9] = 0;
    frame[10] = 0;
    sp = frame;
  }
};

struct Scheduler {
  void* sp = nullptr;
};

inline void switch_in(Scheduler& from, Fiber& to) { qca_emu_switch(&from.sp, to.sp); }
inline void switch_out(Fiber& from, Scheduler& to) { qca_emu_switch(&from.sp, to.sp); }
#else
struct Fiber {
  ucontext_t context;
  char* stack = nullptr;

  void prepare(void (*entry)(void*), void* arg) {
    getcontext(&context);
    context.uc_stack.ss_sp = stack;
    context.uc_stack.ss_size = kStackBytes;
    context.uc_link = nullptr;
    const uintptr_t a = reinterpret_cast<uintptr_t>(arg);
    const uintptr_t f = reinterpret_cast<uintptr_t>(entry);
    makecontext(&context, reinterpret_cast<void (*)()>(&trampoline), 4, (unsigned)(f >> 32),
                (unsigned)f, (unsigned)(a >> 32), (unsigned)a);
  }
  static void trampoline(unsigned f_hi, unsigned f_lo, unsigned a_hi, unsigned a_lo) {
    auto entry = reinterpret_cast<void (*)(void*)>(((uintptr_t)f_hi << 32) | f_lo);
    entry(reinterpret_cast<void*>(((uintptr_t)a_hi << 32) | a_lo));
  }
};

struct Scheduler {
  ucontext_t context;
};

inline void switch_in(Scheduler& from, Fiber& to) { swapcontext(&from.context, &to.context); }
inline void switch_out(Fiber& from, Scheduler& to) { swapcontext(&from.context, &to.context); }
#endif

// ---------------------------------------------------------------------------------------------
// Settings, reports, counters.

int g_sm_count = 132;
int g_shared_optin = 64 * 1024;  // sm_75's limit, the smallest of the architectures built
int g_order = 0;                 // 0 forward, 1 reverse, 2 random
uint64_t g_seed = 0;
cudaError_t g_last_error = cudaSuccess;
cudaError_t g_device_query_error = cudaSuccess;  // injected by tests
std::map<const void*, int> g_max_dynamic_shared;

constexpr size_t kMaxReports = 50;
std::vector<std::string> g_reports;

struct Counters {
  uint64_t launches, blocks, threads, switches;
} g_counters;

// "function at file:line" for a code address of the library, from its symbol table and line
// table (addr2line); only called to write a report.
std::string symbol_name(const void* address) {
  static std::map<const void*, std::string> cache;
  const auto cached = cache.find(address);
  if (cached != cache.end()) return cached->second;
  std::string name;
  Dl_info info;
  if (dladdr(address, &info) && info.dli_fname) {
    char command[1024];
    snprintf(command, sizeof command, "addr2line -f -C -e '%s' 0x%zx 2>/dev/null", info.dli_fname,
             (size_t)(static_cast<const char*>(address) - static_cast<const char*>(info.dli_fbase)));
    if (FILE* pipe = popen(command, "r")) {
      char function[512] = "", line[512] = "";
      if (fgets(function, sizeof function, pipe) && fgets(line, sizeof line, pipe)) {
        function[strcspn(function, "\n")] = 0;
        line[strcspn(line, "\n")] = 0;
        const char* file = strrchr(line, '/');
        name = std::string(function) + " at " + (file ? file + 1 : line);
      }
      pclose(pipe);
    }
  }
  if (name.empty() || name[0] == '?') {
    char buffer[32];
    snprintf(buffer, sizeof buffer, "%p", address);
    name = buffer;
  }
  return cache[address] = name;
}

// ---------------------------------------------------------------------------------------------
// One launch.

enum State : uint8_t { kReady, kAtBlockOp, kAtWarpOp, kDone };

struct Thread {
  Fiber fiber;
  uint3 index;
  int linear;
  State state;
  // What it waits at (block or warp operation) and with what.
  Op op;
  const char* file;
  int line;
  unsigned mask;
  int predicate, lane_arg, width;
  uint64_t value, result;
};

struct SharedArray {
  const void* key;
  size_t offset, bytes;
  const char *name, *function;
};

struct Launch {
  const void* kernel;
  void (*run)(void*);
  void* context;
  dim3 grid, block;
  size_t dynamic_bytes;
  int threads_per_block;
  std::vector<Thread> threads;
  std::vector<int> order;
  std::mt19937_64 random;
  bool aborted;
  std::set<const char*> reported;  // each kind of report once per launch: the first names the cause
  // Current block.
  uint3 block_index;
  int live, at_block_op;
  // Shared memory of the current block: the dynamic part first, then the QCA_SHARED arrays in
  // the order threads first reach their declarations.
  std::vector<SharedArray> arrays;
  size_t shared_used, static_bytes;
};

Launch* g_launch = nullptr;
Thread* g_current = nullptr;
Scheduler g_scheduler;
std::vector<char*> g_stacks;

void report(const char* format, ...) __attribute__((format(printf, 1, 2)));
void report(const char* format, ...) {
  if (g_launch && !g_launch->reported.insert(format).second) return;
  if (g_reports.size() >= kMaxReports) {
    if (g_reports.size() == kMaxReports) g_reports.push_back("(later reports dropped)");
    return;
  }
  char buffer[1024];
  va_list args;
  va_start(args, format);
  vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  std::string text = buffer;
  if (g_launch) {
    const uint3 b = g_launch->block_index;
    char where[64];
    snprintf(where, sizeof where, " [block (%u,%u,%u)]", b.x, b.y, b.z);
    text = symbol_name(g_launch->kernel) + ": " + text + where;
  }
  g_reports.push_back(text);
}

std::string thread_name(const Thread& t) {
  char buffer[64];
  snprintf(buffer, sizeof buffer, "thread (%u,%u,%u)", t.index.x, t.index.y, t.index.z);
  return buffer;
}

const char* base_name(const char* path) {
  const char* slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

const char* op_name(Op op) {
  static const char* const names[] = {
      "__syncthreads", "__syncthreads_or", "__syncthreads_and", "__syncthreads_count",
      "__syncwarp",    "__shfl_sync",      "__shfl_up_sync",    "__shfl_down_sync",
      "__shfl_xor_sync", "__ballot_sync",  "__any_sync",        "__all_sync"};
  return names[op];
}

bool same_site(const Thread& a, const Thread& b) {
  return a.op == b.op && a.line == b.line && (a.file == b.file || strcmp(a.file, b.file) == 0);
}

char* stack_for(size_t i) {
  while (g_stacks.size() <= i) {
    void* region = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (region == MAP_FAILED) abort();
    mprotect(region, kGuardBytes, PROT_NONE);  // an overflow faults instead of corrupting
    g_stacks.push_back(static_cast<char*>(region) + kGuardBytes);
  }
  return g_stacks[i];
}

// ---------------------------------------------------------------------------------------------
// Shared memory and the race detector. Every byte of the arena has a shadow record of its last
// write and last read: who, in which barrier interval. Stamps come from one counter bumped at
// each block start, each block barrier and each full-warp __syncwarp, so records left by earlier
// intervals and earlier blocks compare as ordered without being cleared.

constexpr size_t kArenaBytes = 512 * 1024;
constexpr uint16_t kManyReaders = 0xffff;

struct Shadow {
  uint32_t write_block;  // block serial of the last write (0: never written)
  uint32_t write_stamp, read_stamp;
  uint16_t writer, reader;
  uint8_t write_atomic, read_atomic;
};

unsigned char* g_arena = nullptr;
Shadow* g_shadow = nullptr;
uint32_t g_stamp = 0, g_block_serial = 0;
uint32_t g_block_stamp = 0;          // start of the current barrier interval
std::vector<uint32_t> g_warp_stamp;  // last full __syncwarp of each warp
size_t g_poisoned = 0;               // arena bytes to refill with 0xff before the next block

void ensure_arena() {
  if (g_arena) return;
  g_arena = static_cast<unsigned char*>(mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE,
                                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  g_shadow = static_cast<Shadow*>(mmap(nullptr, kArenaBytes * sizeof(Shadow),
                                       PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (g_arena == MAP_FAILED || g_shadow == MAP_FAILED) abort();
}

uint32_t current_stamp(const Thread& t) {
  const uint32_t warp = g_warp_stamp[t.linear / 32];
  return warp > g_block_stamp ? warp : g_block_stamp;
}

// Whether an access by `other` stamped `stamp` may be concurrent with one by `t` now.
bool concurrent(uint32_t stamp, uint16_t other, const Thread& t) {
  if (stamp < g_block_stamp) return false;
  if (other != kManyReaders && other / 32 == t.linear / 32 && stamp < g_warp_stamp[t.linear / 32])
    return false;
  return true;
}

std::string describe_shared(size_t offset) {
  const Launch& l = *g_launch;
  char buffer[256];
  if (offset < l.dynamic_bytes) {
    snprintf(buffer, sizeof buffer, "dynamic shared memory byte %zu", offset);
    return buffer;
  }
  for (const SharedArray& a : l.arrays) {
    if (offset >= a.offset && offset < a.offset + a.bytes) {
      snprintf(buffer, sizeof buffer, "%s::%s byte %zu", a.function, a.name, offset - a.offset);
      return buffer;
    }
  }
  snprintf(buffer, sizeof buffer, "shared memory byte %zu (no array)", offset);
  return buffer;
}

std::string thread_at(uint16_t linear) {
  if (linear == kManyReaders) return "several threads";
  return thread_name(g_launch->threads[linear]);
}

void race(const char* kind, size_t offset, const Thread& t, uint16_t other, const void* pc) {
  report("shared-memory race (%s) on %s: %s at %s and %s in the same barrier interval", kind,
         describe_shared(offset).c_str(), thread_name(t).c_str(), symbol_name(pc).c_str(),
         thread_at(other).c_str());
}

void shared_access(size_t offset, size_t bytes, bool write, bool atomic, const void* pc) {
  const Thread& t = *g_current;
  const uint16_t me = (uint16_t)t.linear;
  const uint32_t stamp = current_stamp(t);
  if (offset + bytes > kArenaBytes) bytes = kArenaBytes - offset;
  for (size_t i = offset; i < offset + bytes; ++i) {
    Shadow& s = g_shadow[i];
    const bool written_here = s.write_block == g_block_serial;
    if (!written_here && (!write || atomic)) {
      report("reads %s before any thread of the block wrote it (shared memory starts undefined), "
             "%s at %s", describe_shared(i).c_str(), thread_name(t).c_str(),
             symbol_name(pc).c_str());
    }
    if (written_here && s.writer != me && !(atomic && s.write_atomic) &&
        concurrent(s.write_stamp, s.writer, t))
      race(write ? "write after write" : "read after write", i, t, s.writer, pc);
    if (write && s.read_stamp && s.reader != me && !(atomic && s.read_atomic) &&
        concurrent(s.read_stamp, s.reader, t))
      race("write after read", i, t, s.reader, pc);
    if (write) {
      s.write_block = g_block_serial;
      s.write_stamp = stamp;
      s.writer = me;
      s.write_atomic = atomic;
    }
    if (!write || atomic) {
      const bool other_reader = s.read_stamp && s.reader != me && concurrent(s.read_stamp, s.reader, t);
      s.reader = other_reader ? kManyReaders : me;
      s.read_stamp = stamp;
      s.read_atomic = atomic && !(other_reader && !s.read_atomic);
    }
  }
}

inline void access(const void* address, size_t bytes, bool write, const void* pc) {
  if (!g_current) return;
  const size_t offset = (size_t)(static_cast<const unsigned char*>(address) - g_arena);
  if (offset >= kArenaBytes) return;
  shared_access(offset, bytes, write, false, pc);
}

void check_shared_limit() {
  Launch& l = *g_launch;
  const auto attribute = g_max_dynamic_shared.find(l.kernel);
  const bool opted_in = attribute != g_max_dynamic_shared.end();
  const size_t limit = opted_in ? (size_t)g_shared_optin : 48 * 1024;
  if (l.static_bytes > 48 * 1024 || l.static_bytes + l.dynamic_bytes > limit) {
    report("uses %zu bytes of static and %zu of dynamic shared memory, over the %zu a block may "
           "have%s", l.static_bytes, l.dynamic_bytes, limit,
           opted_in ? "" : " without cudaFuncSetAttribute");
  }
}

// ---------------------------------------------------------------------------------------------
// Scheduling.

void fiber_main(void* arg) {
  Thread* t = static_cast<Thread*>(arg);
  g_launch->run(g_launch->context);
  t->state = kDone;
  switch_out(t->fiber, g_scheduler);
  abort();  // a finished fiber is never resumed
}

void run_thread(Thread& t) {
  threadIdx = t.index;
  g_current = &t;
  ++g_counters.switches;
  switch_in(g_scheduler, t.fiber);
  g_current = nullptr;
}

// Called by a thread at a rendezvous: back to the scheduler until it is released.
void wait_here() {
  Thread& t = *g_current;
  switch_out(t.fiber, g_scheduler);
}

void release_block_op() {
  Launch& l = *g_launch;
  const Thread* first = nullptr;
  bool divergent = false;
  int any = 0, all = 1, count = 0;
  for (const Thread& t : l.threads) {
    if (t.state != kAtBlockOp) continue;
    if (!first) first = &t;
    else if (!same_site(*first, t)) divergent = true;
    any |= t.predicate != 0;
    all &= t.predicate != 0;
    count += t.predicate != 0;
  }
  if (divergent) {
    std::string sites;
    for (const Thread& t : l.threads) {
      if (t.state == kAtBlockOp && !same_site(*first, t)) {
        char buffer[512];
        snprintf(buffer, sizeof buffer, "%s at %s (%s:%d), %s at %s (%s:%d)",
                 thread_name(*first).c_str(), op_name(first->op), base_name(first->file), first->line,
                 thread_name(t).c_str(), op_name(t.op), base_name(t.file), t.line);
        sites = buffer;
        break;
      }
    }
    report("divergent barrier: the block's threads wait at different barriers: %s", sites.c_str());
  }
  if (l.live < l.threads_per_block) {
    report("%s (%s:%d) reached after %d of the block's threads returned: a barrier must be "
           "reached by every thread of the block", op_name(first->op), base_name(first->file), first->line,
           l.threads_per_block - l.live);
  }
  for (Thread& t : l.threads) {
    if (t.state != kAtBlockOp) continue;
    switch (t.op) {
      case kSyncThreadsOr: t.result = any; break;
      case kSyncThreadsAnd: t.result = all; break;
      case kSyncThreadsCount: t.result = count; break;
      default: t.result = 0;
    }
    t.state = kReady;
  }
  l.at_block_op = 0;
  g_block_stamp = ++g_stamp;
}

int lane_count(int warp) {
  const int n = g_launch->threads_per_block - warp * 32;
  return n < 32 ? n : 32;
}

// Releases the warp operation `t` waits at once every lane its mask names has arrived at the
// same call with the same mask. Returns false if some named lane has not arrived yet.
bool try_release_warp_op(Thread& t) {
  Launch& l = *g_launch;
  const int warp = t.linear / 32, lanes = lane_count(warp);
  Thread* lane_thread[32] = {};
  for (int lane = 0; lane < 32; ++lane) {
    if (!(t.mask >> lane & 1u)) continue;
    if (lane >= lanes) return false;  // reported when the scheduler stalls
    Thread& u = l.threads[warp * 32 + lane];
    if (u.state != kAtWarpOp) return false;
    lane_thread[lane] = &u;
  }
  for (int lane = 0; lane < 32; ++lane) {
    Thread* u = lane_thread[lane];
    if (u && (!same_site(t, *u) || u->mask != t.mask)) {
      report("divergent %s: %s at %s:%d with mask 0x%08x, %s at %s (%s:%d) with mask 0x%08x",
             op_name(t.op), thread_name(t).c_str(), base_name(t.file), t.line, t.mask,
             thread_name(*u).c_str(), op_name(u->op), base_name(u->file), u->line, u->mask);
      l.aborted = true;
      return true;
    }
  }
  uint32_t ballot = 0;
  for (int lane = 0; lane < 32; ++lane)
    if (lane_thread[lane] && lane_thread[lane]->value) ballot |= 1u << lane;
  for (int lane = 0; lane < 32; ++lane) {
    Thread* u = lane_thread[lane];
    if (!u) continue;
    const int width = u->width, segment = lane / width * width;
    int source = lane;
    switch (u->op) {
      case kShfl: source = segment + (u->lane_arg & (width - 1)); break;
      case kShflUp: source = lane - segment >= u->lane_arg ? lane - u->lane_arg : lane; break;
      case kShflDown: source = lane - segment + u->lane_arg < width ? lane + u->lane_arg : lane; break;
      case kShflXor: {
        const int x = lane ^ u->lane_arg;
        source = x < segment + width ? x : lane;
        break;
      }
      default: break;
    }
    switch (u->op) {
      case kBallot: u->result = ballot; break;
      case kAny: u->result = ballot != 0; break;
      case kAll: u->result = ballot == t.mask; break;
      case kSyncWarp: u->result = 0; break;
      default:
        if (!(t.mask >> source & 1u)) {
          report("%s (%s:%d): lane %d reads lane %d, which the mask 0x%08x leaves out",
                 op_name(u->op), base_name(u->file), u->line, lane, source, t.mask);
          source = lane;
        }
        u->result = lane_thread[source]->value;
    }
    u->state = kReady;
  }
  if (t.op == kSyncWarp && t.mask == (lanes == 32 ? 0xffffffffu : (1u << lanes) - 1))
    g_warp_stamp[warp] = ++g_stamp;
  return true;
}

// Nothing can run: say who waits where, and give up on the launch.
void report_stall() {
  Launch& l = *g_launch;
  std::string detail;
  for (const Thread& t : l.threads) {
    if (t.state != kAtWarpOp) continue;
    const int warp = t.linear / 32, lanes = lane_count(warp);
    for (int lane = 0; lane < 32 && detail.empty(); ++lane) {
      if (!(t.mask >> lane & 1u)) continue;
      char buffer[512];
      if (lane >= lanes) {
        snprintf(buffer, sizeof buffer, "%s waits at %s (%s:%d) with mask 0x%08x, which names "
                 "lane %d of a warp of %d threads", thread_name(t).c_str(), op_name(t.op),
                 base_name(t.file), t.line, t.mask, lane, lanes);
        detail = buffer;
        break;
      }
      const Thread& u = l.threads[warp * 32 + lane];
      if (u.state == kAtWarpOp) continue;
      snprintf(buffer, sizeof buffer, "%s waits at %s (%s:%d) with mask 0x%08x for lane %d, %s",
               thread_name(t).c_str(), op_name(t.op), base_name(t.file), t.line, t.mask, lane,
               u.state == kDone ? "which returned" : "which waits at a block barrier");
      detail = buffer;
    }
    if (!detail.empty()) break;
  }
  if (detail.empty()) detail = "no thread can proceed";
  report("deadlock: %s", detail.c_str());
  l.aborted = true;
}

void run_block(Launch& l) {
  // A fresh block: stamps move on, the arena bytes the previous block used become undefined.
  g_block_serial += 1;
  g_block_stamp = ++g_stamp;
  std::fill(g_warp_stamp.begin(), g_warp_stamp.end(), 0);
  memset(g_arena, 0xff, g_poisoned);
  l.arrays.clear();
  l.shared_used = (l.dynamic_bytes + 15) / 16 * 16;
  l.static_bytes = 0;
  l.live = l.threads_per_block;
  l.at_block_op = 0;
  for (Thread& t : l.threads) {
    t.state = kReady;
    t.fiber.prepare(&fiber_main, &t);
  }
  ++g_counters.blocks;
  g_counters.threads += l.threads_per_block;
  while (!l.aborted) {
    if (g_order == 2) std::shuffle(l.order.begin(), l.order.end(), l.random);
    bool ran = false;
    for (int i : l.order) {
      Thread& t = l.threads[i];
      if (t.state != kReady) continue;
      ran = true;
      run_thread(t);
      if (t.state == kDone) --l.live;
      if (t.state == kAtBlockOp) ++l.at_block_op;
      if (t.state == kAtWarpOp) try_release_warp_op(t);
      if (l.at_block_op > 0 && l.at_block_op == l.live) release_block_op();
      if (l.aborted) break;
    }
    if (l.live == 0 || l.aborted) break;
    if (!ran) report_stall();
  }
  g_poisoned = std::max(g_poisoned, l.shared_used);
}

const char* validate(const cudaLaunchConfig_t& c) {
  const dim3 g = c.gridDim, b = c.blockDim;
  if (b.x == 0 || b.y == 0 || b.z == 0) return "a block dimension is 0";
  if (b.x > 1024 || b.y > 1024 || b.z > 64) return "block dimensions over (1024, 1024, 64)";
  if ((uint64_t)b.x * b.y * b.z > 1024) return "more than 1024 threads per block";
  if (g.x == 0 || g.y == 0 || g.z == 0) return "a grid dimension is 0";
  if (g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) return "grid dimensions over (2^31 - 1, 65535, 65535)";
  return nullptr;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The interface of cuda_emu.h.

cudaError_t launch(const void* kernel, const cudaLaunchConfig_t& config, void (*run)(void*),
                   void* context) {
  if (g_launch) abort();  // kernels launch nothing
  ++g_counters.launches;
  if (const char* problem = validate(config)) {
    g_reports.push_back(symbol_name(kernel) + ": invalid launch configuration: " + problem);
    return g_last_error = cudaErrorInvalidConfiguration;
  }
  const auto attribute = g_max_dynamic_shared.find(kernel);
  const size_t dynamic_limit = attribute == g_max_dynamic_shared.end() ? 48 * 1024 : attribute->second;
  if (config.dynamicSmemBytes > dynamic_limit) {
    char buffer[160];
    snprintf(buffer, sizeof buffer, "%zu bytes of dynamic shared memory, over the %zu allowed",
             config.dynamicSmemBytes, dynamic_limit);
    g_reports.push_back(symbol_name(kernel) + ": invalid launch configuration: " + buffer);
    return g_last_error = cudaErrorInvalidConfiguration;
  }
  ensure_arena();
  Launch l;
  l.kernel = kernel;
  l.run = run;
  l.context = context;
  l.grid = config.gridDim;
  l.block = config.blockDim;
  l.dynamic_bytes = config.dynamicSmemBytes;
  l.threads_per_block = (int)(l.block.x * l.block.y * l.block.z);
  l.threads.resize(l.threads_per_block);
  l.order.resize(l.threads_per_block);
  l.random.seed(g_seed);
  l.aborted = false;
  for (int i = 0; i < l.threads_per_block; ++i) {
    Thread& t = l.threads[i];
    t.linear = i;
    t.index = {i % l.block.x, i / l.block.x % l.block.y, i / (l.block.x * l.block.y)};
    t.fiber.stack = stack_for(i);
    l.order[i] = g_order == 1 ? l.threads_per_block - 1 - i : i;
  }
  g_warp_stamp.assign((l.threads_per_block + 31) / 32, 0);
  blockDim = l.block;
  gridDim = l.grid;

  std::vector<uint3> blocks;
  blocks.reserve((size_t)l.grid.x * l.grid.y * l.grid.z);
  for (unsigned z = 0; z < l.grid.z; ++z)
    for (unsigned y = 0; y < l.grid.y; ++y)
      for (unsigned x = 0; x < l.grid.x; ++x) blocks.push_back({x, y, z});
  if (g_order == 1) std::reverse(blocks.begin(), blocks.end());
  if (g_order == 2) std::shuffle(blocks.begin(), blocks.end(), l.random);

  g_launch = &l;
  for (const uint3& b : blocks) {
    l.block_index = blockIdx = b;
    run_block(l);
    if (l.aborted) break;
  }
  g_launch = nullptr;
  // Errors inside a kernel surface at the next synchronisation on a GPU; the emulator runs the
  // launch to its end here and reports them through the report list (a failed test), and a
  // launch it had to abandon leaves cudaErrorLaunchFailure, as a trapped kernel would.
  if (l.aborted) g_last_error = cudaErrorLaunchFailure;
  return cudaSuccess;
}

int block_op(Op op, int predicate, const char* file, int line) {
  Thread& t = *g_current;
  t.state = kAtBlockOp;
  t.op = op;
  t.file = file;
  t.line = line;
  t.predicate = predicate;
  wait_here();
  return (int)t.result;
}

uint64_t warp_op(Op op, unsigned mask, uint64_t value, int lane_arg, int width, const char* file,
                 int line) {
  Thread& t = *g_current;
  const int lane = t.linear % 32;
  // Undefined on a GPU; reported, then the lane goes on alone.
  if (!(mask >> lane & 1u)) {
    report("%s (%s:%d): lane %d calls it with mask 0x%08x, which leaves it out", op_name(op),
           base_name(file), line, lane, mask);
    mask = 1u << lane;
  }
  if (width < 1 || width > 32 || (width & (width - 1))) {
    report("%s (%s:%d): width %d is not a power of two up to 32", op_name(op), base_name(file), line, width);
    width = 32;
  }
  t.state = kAtWarpOp;
  t.op = op;
  t.file = file;
  t.line = line;
  t.mask = mask;
  t.value = value;
  t.lane_arg = lane_arg;
  t.width = width;
  wait_here();
  return t.result;
}

void* shared_array(const void* key, size_t bytes, size_t align, const char* name,
                   const char* function) {
  Launch& l = *g_launch;
  for (const SharedArray& a : l.arrays)
    if (a.key == key) return g_arena + a.offset;
  size_t offset = (l.shared_used + align - 1) / align * align;
  if (offset + bytes > kArenaBytes) {
    report("shared memory over the emulator's %zu bytes", kArenaBytes);
    l.aborted = true;
    offset = 0;
  }
  l.arrays.push_back({key, offset, bytes, name, function});
  l.shared_used = offset + bytes;
  l.static_bytes += bytes;
  check_shared_limit();
  return g_arena + offset;
}

void* dynamic_shared() { return g_arena; }

void atomic_access(const void* address, size_t bytes) {
  if (!g_current) return;
  const size_t offset = (size_t)(static_cast<const unsigned char*>(address) - g_arena);
  if (offset < kArenaBytes) shared_access(offset, bytes, true, true, __builtin_return_address(0));
}

cudaError_t set_max_dynamic_shared(const void* kernel, int bytes) {
  if (bytes < 0 || bytes > g_shared_optin) return g_last_error = cudaErrorInvalidValue;
  g_max_dynamic_shared[kernel] = bytes;
  return cudaSuccess;
}

}  // namespace qca_emu

// ---------------------------------------------------------------------------------------------
// The CUDA runtime calls.

using qca_emu::g_last_error;

cudaError_t cudaGetDevice(int* device) {
  if (qca_emu::g_device_query_error != cudaSuccess) return g_last_error = qca_emu::g_device_query_error;
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (qca_emu::g_device_query_error != cudaSuccess) return g_last_error = qca_emu::g_device_query_error;
  if (device != 0) return g_last_error = cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = qca_emu::g_sm_count; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = qca_emu::g_shared_optin; return cudaSuccess;
  }
  return g_last_error = cudaErrorInvalidValue;
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = g_last_error;
  g_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() { return g_last_error; }

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

// ---------------------------------------------------------------------------------------------
// Control for the tests (ctypes).

extern "C" {

void qca_emu_configure(int sm_count, int shared_optin, int order, uint64_t seed) {
  qca_emu::g_sm_count = sm_count;
  qca_emu::g_shared_optin = shared_optin;
  qca_emu::g_order = order;
  qca_emu::g_seed = seed;
}

// Makes cudaGetDevice / cudaDeviceGetAttribute fail with `code` (0: succeed again).
void qca_emu_fail_device_queries(int code) { qca_emu::g_device_query_error = (cudaError_t)code; }

void qca_emu_set_last_error(int code) { g_last_error = (cudaError_t)code; }
int qca_emu_peek_last_error() { return g_last_error; }

int qca_emu_report_count() { return (int)qca_emu::g_reports.size(); }
const char* qca_emu_report(int i) { return qca_emu::g_reports[(size_t)i].c_str(); }
void qca_emu_clear_reports() { qca_emu::g_reports.clear(); }

// launches, blocks, threads, fiber switches since the library was loaded
void qca_emu_counters(uint64_t out[4]) {
  out[0] = qca_emu::g_counters.launches;
  out[1] = qca_emu::g_counters.blocks;
  out[2] = qca_emu::g_counters.threads;
  out[3] = qca_emu::g_counters.switches;
}

// ---- ThreadSanitizer's instrumentation calls, for the kernels' loads and stores ----

#define QCA_EMU_TSAN_ACCESS(bytes)                                                          \
  void __tsan_read##bytes(void* a) { qca_emu::access(a, bytes, false, __builtin_return_address(0)); } \
  void __tsan_write##bytes(void* a) { qca_emu::access(a, bytes, true, __builtin_return_address(0)); } \
  void __tsan_unaligned_read##bytes(void* a) { qca_emu::access(a, bytes, false, __builtin_return_address(0)); } \
  void __tsan_unaligned_write##bytes(void* a) { qca_emu::access(a, bytes, true, __builtin_return_address(0)); } \
  void __tsan_volatile_read##bytes(void* a) { qca_emu::access(a, bytes, false, __builtin_return_address(0)); } \
  void __tsan_volatile_write##bytes(void* a) { qca_emu::access(a, bytes, true, __builtin_return_address(0)); }
QCA_EMU_TSAN_ACCESS(1)
QCA_EMU_TSAN_ACCESS(2)
QCA_EMU_TSAN_ACCESS(4)
QCA_EMU_TSAN_ACCESS(8)
QCA_EMU_TSAN_ACCESS(16)
#undef QCA_EMU_TSAN_ACCESS

void __tsan_read_range(void* a, size_t n) { qca_emu::access(a, n, false, __builtin_return_address(0)); }
void __tsan_write_range(void* a, size_t n) { qca_emu::access(a, n, true, __builtin_return_address(0)); }
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}

}  // extern "C"
