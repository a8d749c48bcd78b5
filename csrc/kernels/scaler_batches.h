// Host-side plan of the multi-tensor launches of scaler.cu: which chunks of which tensors each
// launch covers. Plain C++ without CUDA, so that a CPU-only test can check the plan.
#ifndef QCA_LOWMEM_SCALER_BATCHES_H
#define QCA_LOWMEM_SCALER_BATCHES_H

#include <stdint.h>

#include "qca_lowmem/scaler.h"

namespace qca_scaler_batches {

constexpr int kMaxTensors = 64;
constexpr int kMaxEntries = 320;

// Kernel argument, passed by value. Under the 4 KiB limit of older toolkits:
// 64*8*3 + 320*(2+4) = 3456 bytes.
struct ChunkBatch {
  void* data[kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t first_partial[kMaxTensors];  // workspace slot of the tensor's first part
  uint16_t entry_tensor[kMaxEntries];
  int32_t entry_chunk[kMaxEntries];
};

// Calls launch(batch, entries) for each batch of up to kMaxTensors tensors and kMaxEntries
// chunks, in order; a tensor cut by a full batch continues in slot 0 of the next. Empty tensors
// take no chunk. Each chunk owns `split` consecutive workspace slots. Stops at the first status
// that is not QCA_OK and returns it.
template <typename Launch>
qca_status for_each_batch(void* const* tensors, const int64_t* numel, int64_t n_tensors, int split,
                          Launch launch) {
  ChunkBatch batch;
  int slots = 0, entries = 0;
  int64_t next_partial = 0;
  for (int64_t t = 0; t < n_tensors; ++t) {
    const int64_t n = numel[t];
    if (n == 0) continue;
    const int64_t chunks = (n + QCA_SCALER_CHUNK - 1) / QCA_SCALER_CHUNK;
    batch.data[slots] = tensors[t];
    batch.numel[slots] = n;
    batch.first_partial[slots] = next_partial;
    next_partial += chunks * split;
    ++slots;
    for (int64_t c = 0; c < chunks; ++c) {
      batch.entry_tensor[entries] = (uint16_t)(slots - 1);
      batch.entry_chunk[entries] = (int32_t)c;
      ++entries;
      const bool last_chunk = c == chunks - 1;
      if (entries == kMaxEntries || (slots == kMaxTensors && last_chunk)) {
        const qca_status s = launch(batch, entries);
        if (s != QCA_OK) return s;
        entries = 0;
        if (last_chunk) {
          slots = 0;
        } else {
          batch.data[0] = batch.data[slots - 1];
          batch.numel[0] = batch.numel[slots - 1];
          batch.first_partial[0] = batch.first_partial[slots - 1];
          slots = 1;
        }
      }
    }
  }
  return entries > 0 ? launch(batch, entries) : QCA_OK;
}

}  // namespace qca_scaler_batches

#endif
