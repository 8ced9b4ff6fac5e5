// A kernel tracer loaded with LD_PRELOAD (CUPTI activity API; bench/gpu-trace-decode.sh builds
// and runs it): every kernel's (start ns, end ns, stream, name), the ones CUDA graphs launch
// included, written to $KTRACE_OUT.<pid> as tab-separated lines; CUPTI hands its buffers over
// every 50 ms and at exit. For the GPU machine, where Nsight Systems is not installed: the
// times are those of the real run (no replay per kernel, unlike Nsight Compute), the kernels'
// own overlap (programmatic dependent launch) kept; CUPTI adds some time between steps.
#include <cupti.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unistd.h>

namespace {
std::FILE* out = nullptr;
std::mutex mu;
void CUPTIAPI requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = 8 << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}
void CUPTIAPI completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* r = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel4*>(r);
      if (out) std::fprintf(out, "%llu\t%llu\t%u\t%s\n", (unsigned long long)k->start,
                            (unsigned long long)k->end, k->streamId, k->name);
    }
  }
  if (out) std::fflush(out);
  std::free(buffer);
}
struct init {
  init() {
    const char* path = std::getenv("KTRACE_OUT");
    if (!path) return;
    char name[512];
    std::snprintf(name, sizeof name, "%s.%d", path, (int)getpid());
    out = std::fopen(name, "w");
    cuptiActivityRegisterCallbacks(requested, completed);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityFlushPeriod(50);
  }
  ~init() {
    if (!out) return;
    cuptiActivityFlushAll(1);
    std::fclose(out);
    out = nullptr;
  }
} the_init;
} // namespace
