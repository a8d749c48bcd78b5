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

// Kernel argument of the gradient accumulation: each slot a pair of tensors with their element
// types. 64*8*3 + 64*2 + 320*(2+4) = 3584 bytes.
struct AccumulateBatch {
  void* accumulator[kMaxTensors];
  const void* grad[kMaxTensors];
  int64_t numel[kMaxTensors];
  uint8_t accumulator_dtype[kMaxTensors];
  uint8_t grad_dtype[kMaxTensors];
  uint16_t entry_tensor[kMaxEntries];
  int32_t entry_chunk[kMaxEntries];
};

// Calls launch(batch, entries) for each batch of up to kMaxTensors tensors and kMaxEntries
// chunks, in order, after set_slot(batch, slot, tensor, first_partial) has put each of its
// tensors in a slot; a tensor cut by a full batch continues in slot 0 of the next. Empty tensors
// take no chunk. Each chunk owns `split` consecutive workspace slots, from the tensor's
// first_partial on. Stops at the first status that is not QCA_OK and returns it.
template <typename Batch, typename SetSlot, typename Launch>
qca_status plan_batches(const int64_t* numel, int64_t n_tensors, int split, SetSlot set_slot,
                        Launch launch) {
  Batch batch;
  int slots = 0, entries = 0;
  int64_t next_partial = 0;
  for (int64_t t = 0; t < n_tensors; ++t) {
    const int64_t n = numel[t];
    if (n == 0) continue;
    const int64_t chunks = (n + QCA_SCALER_CHUNK - 1) / QCA_SCALER_CHUNK;
    const int64_t first_partial = next_partial;
    set_slot(batch, slots, t, first_partial);
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
          set_slot(batch, 0, t, first_partial);
          slots = 1;
        }
      }
    }
  }
  return entries > 0 ? launch(batch, entries) : QCA_OK;
}

// plan_batches for the loss scaler's lists: ChunkBatch slots of one data pointer each.
template <typename Launch>
qca_status for_each_batch(void* const* tensors, const int64_t* numel, int64_t n_tensors, int split,
                          Launch launch) {
  return plan_batches<ChunkBatch>(
      numel, n_tensors, split,
      [&](ChunkBatch& batch, int slot, int64_t t, int64_t first_partial) {
        batch.data[slot] = tensors[t];
        batch.numel[slot] = numel[t];
        batch.first_partial[slot] = first_partial;
      },
      launch);
}

}  // namespace qca_scaler_batches

#endif
