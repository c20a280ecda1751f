// SPDX-License-Identifier: Apache-2.0
// Torch binding of the HiSparse CUDA kernels: registers torch.ops._hisparse_C.*.
//
// Each op has three implementations:
// - CUDA: checks what the kernel relies on, then launches it on the current stream;
// - Meta: the same checks on shapes and dtypes, no work (fake tensors and tracing use it);
// - CPU: refuses with a message naming the torch reference to call instead.
// Index values are range-checked in the kernels (an error word, read once per step);
// duplicates are refused by the Python callers (vllm/v1/hisparse/resolver.py, page_copy.py)
// before the indices reach the device.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <atomic>

#include "hisparse_apply.h"
#include "hisparse_page_copy.h"
#include "hisparse_plan_launch.h"
#include "hisparse_row_copy.h"

namespace {

// Copy launches that fell back to byte-by-byte copies because a row, page, stride or base
// address was not 16-byte aligned (row_copy_in_words, page_copy_in_words): counted for the
// worker's metrics (narrow_copy_launches), and warned about once per kind.
std::atomic<int64_t> narrow_copy_launch_count{0};

int64_t narrow_copy_launches() { return narrow_copy_launch_count.load(); }

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(), name,
              " must be a contiguous 1-D int64 tensor, got ", t.sizes(), " ", t.scalar_type());
}

void check_error_word(const at::Tensor& error) {
  TORCH_CHECK(error.scalar_type() == at::kLong && error.numel() == 1 && error.is_contiguous(),
              "error must be a one-element int64 tensor (the step's error word)");
}

void check_same_device(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", expected ",
              like.device());
}

// The device address of host memory the kernels read through its mapping, from the driver's
// own record of the pointer (cudaPointerGetAttributes): a torch pinned allocation and an
// mmap registered with cudaHostRegister (the production host pool) pass alike; pageable
// memory is refused naming the tensor.
const void* mapped_host_pointer(const at::Tensor& host, const char* name) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, host.data_ptr());
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // pageable memory on older drivers: not a sticky error
  }
  TORCH_CHECK(status == cudaSuccess && attributes.type == cudaMemoryTypeHost &&
                  attributes.devicePointer != nullptr,
              name, " must be pinned or CUDA-registered (mapped) host memory");
  return attributes.devicePointer;
}

// The layer a row copy writes, for the row copy and the replay: kv_rows and host_rows as
// check_copy_host_rows takes them (checked), block b's own rows of kv_rows at
// b * block_stride_rows + [0, block_rows).
hisparse::RowCopyLayer row_copy_layer(at::Tensor& kv_rows, const at::Tensor& host_rows,
                                      int64_t block_stride_rows, int64_t block_rows) {
  hisparse::RowCopyLayer layer{};
  layer.kv_rows = static_cast<char*>(kv_rows.data_ptr());
  layer.kv_row_stride = kv_rows.stride(0) * kv_rows.element_size();
  layer.kv_num_rows = kv_rows.size(0);
  layer.kv_block_stride_rows = block_stride_rows;
  layer.kv_block_rows = block_rows;
  layer.host_rows = static_cast<const char*>(mapped_host_pointer(host_rows, "host_rows"));
  layer.host_row_stride = host_rows.stride(0) * host_rows.element_size();
  layer.host_num_rows = host_rows.size(0);
  layer.row_bytes = kv_rows.size(1) * kv_rows.element_size();
  return layer;
}

// A copy launch that moves bytes, not 16-byte words: counted, and warned about once.
void note_narrow_copies(const char* what, int64_t bytes) {
  ++narrow_copy_launch_count;
  TORCH_WARN_ONCE("HiSparse ", what, " of ", bytes,
                  " bytes, their strides or base addresses are not 16-byte aligned, so they are "
                  "copied byte by byte, many times slower; vllm:hisparse_narrow_copy_launches "
                  "counts such launches");
}

// kv_rows: [rows, width] with contiguous columns; host_rows: [rows, width] host memory, same
// row bytes; dst_rows / src_rows: int64 [n]; copy: bool [n]; error: int64 [1] or [].
// block_stride_rows / block_rows: block b's rows of this layer are
// b * block_stride_rows + [0, block_rows) of kv_rows.
void check_copy_host_rows(const at::Tensor& kv_rows, const at::Tensor& dst_rows,
                          const at::Tensor& host_rows, const at::Tensor& src_rows,
                          const at::Tensor& copy, const at::Tensor& error,
                          int64_t block_stride_rows, int64_t block_rows) {
  TORCH_CHECK(block_rows > 0 && block_stride_rows >= block_rows,
              "block_rows must be positive and at most block_stride_rows, got ", block_rows,
              " and ", block_stride_rows);
  TORCH_CHECK(kv_rows.dim() == 2 && kv_rows.stride(1) == 1,
              "kv_rows must be rows [rows, width] with contiguous columns, got ", kv_rows.sizes());
  TORCH_CHECK(host_rows.dim() == 2 && host_rows.stride(1) == 1,
              "host_rows must be rows [rows, width] with contiguous columns, got ",
              host_rows.sizes());
  TORCH_CHECK(
      kv_rows.size(1) * kv_rows.element_size() == host_rows.size(1) * host_rows.element_size(),
      "kv_rows rows are ", kv_rows.size(1) * kv_rows.element_size(), " bytes, host_rows rows ",
      host_rows.size(1) * host_rows.element_size());
  check_index(dst_rows, "dst_rows");
  check_index(src_rows, "src_rows");
  TORCH_CHECK(copy.scalar_type() == at::kBool && copy.dim() == 1 && copy.is_contiguous(),
              "copy must be a contiguous 1-D bool tensor");
  TORCH_CHECK(dst_rows.numel() == src_rows.numel() && copy.numel() == dst_rows.numel(),
              "dst_rows, src_rows and copy must have one entry each, got ", dst_rows.numel(), ", ",
              src_rows.numel(), " and ", copy.numel());
  check_error_word(error);
  for (const auto* t : {&dst_rows, &src_rows, &copy, &error})
    check_same_device(*t, kv_rows, "an index");
}

void copy_host_rows_meta(at::Tensor& kv_rows, const at::Tensor& dst_rows,
                         const at::Tensor& host_rows, const at::Tensor& src_rows,
                         const at::Tensor& copy, at::Tensor& error, int64_t block_stride_rows,
                         int64_t block_rows) {
  check_copy_host_rows(kv_rows, dst_rows, host_rows, src_rows, copy, error, block_stride_rows,
                       block_rows);
}

void copy_host_rows_cuda(at::Tensor& kv_rows, const at::Tensor& dst_rows,
                         const at::Tensor& host_rows, const at::Tensor& src_rows,
                         const at::Tensor& copy, at::Tensor& error, int64_t block_stride_rows,
                         int64_t block_rows) {
  check_copy_host_rows(kv_rows, dst_rows, host_rows, src_rows, copy, error, block_stride_rows,
                       block_rows);
  TORCH_CHECK(kv_rows.is_cuda(), "kv_rows must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(kv_rows.device());
  hisparse::RowCopyArgs args{};
  args.layer = row_copy_layer(kv_rows, host_rows, block_stride_rows, block_rows);
  args.dst_rows = dst_rows.data_ptr<int64_t>();
  args.src_rows = src_rows.data_ptr<int64_t>();
  args.copy = copy.data_ptr<bool>();
  args.n = dst_rows.numel();
  args.error = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
  if (args.n > 0 && !hisparse::row_copy_in_words(args.layer)) {
    note_narrow_copies("row copy: rows", args.layer.row_bytes);
  }
  C10_CUDA_CHECK(hisparse::launch_copy_host_rows(args, c10::cuda::getCurrentCUDAStream()));
}

void copy_host_rows_cpu(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, at::Tensor&, int64_t, int64_t) {
  TORCH_CHECK(
      false,
      "_hisparse_C::copy_host_rows is the CUDA kernel and needs CUDA tensors; for CPU tensors "
      "call the torch reference, vllm.v1.hisparse.resolver.copy_host_rows");
}

// rows, on_host, entry_request, entry_slot: [T, K] (rows int32/int64, on_host bool, the others
// int64); load: bool [T * K]; load_request, load_slot, load_host_row: int64 [T * K];
// slot_rows, copy_rows: int64 [M, W]; kv_rows, host_rows, error, block_stride_rows,
// block_rows: as copy_host_rows. Every tensor contiguous.
void check_apply_resolution(const at::Tensor& rows, const at::Tensor& on_host,
                            const at::Tensor& entry_request, const at::Tensor& entry_slot,
                            const at::Tensor& slot_rows, const at::Tensor& kv_rows,
                            const at::Tensor& copy_rows, const at::Tensor& host_rows,
                            const at::Tensor& load, const at::Tensor& load_request,
                            const at::Tensor& load_slot, const at::Tensor& load_host_row,
                            const at::Tensor& error, int64_t block_stride_rows,
                            int64_t block_rows) {
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() &&
                  (rows.scalar_type() == at::kInt || rows.scalar_type() == at::kLong),
              "rows must be a contiguous [T, K] int32/int64 tensor, got ", rows.sizes(), " ",
              rows.scalar_type());
  TORCH_CHECK(on_host.scalar_type() == at::kBool && on_host.sizes() == rows.sizes() &&
                  on_host.is_contiguous(),
              "on_host must be a contiguous bool tensor shaped like rows ", rows.sizes());
  for (const auto* t : {&entry_request, &entry_slot}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->sizes() == rows.sizes() && t->is_contiguous(),
                "entry_request and entry_slot must be contiguous int64 tensors shaped like rows ",
                rows.sizes());
  }
  const int64_t n = rows.numel();
  TORCH_CHECK(load.scalar_type() == at::kBool && load.dim() == 1 && load.numel() == n &&
                  load.is_contiguous(),
              "load must be a contiguous bool [", n, "] tensor");
  for (const auto* t : {&load_request, &load_slot, &load_host_row}) {
    check_index(*t, "a load array");
    TORCH_CHECK(t->numel() == n, "the load arrays must have ", n, " entries, got ", t->numel());
  }
  TORCH_CHECK(slot_rows.scalar_type() == at::kLong && slot_rows.dim() == 2 &&
                  slot_rows.is_contiguous() && copy_rows.sizes() == slot_rows.sizes() &&
                  copy_rows.scalar_type() == at::kLong && copy_rows.is_contiguous(),
              "slot_rows and copy_rows must be contiguous int64 [M, W] tensors of one shape, got ",
              slot_rows.sizes(), " and ", copy_rows.sizes());
  check_copy_host_rows(kv_rows, load_request, host_rows, load_host_row, load, error,
                       block_stride_rows, block_rows);
  for (const auto* t :
       {&rows, &on_host, &entry_request, &entry_slot, &slot_rows, &copy_rows, &load_slot})
    check_same_device(*t, kv_rows, "an index");
}

at::Tensor apply_resolution_meta(const at::Tensor& rows, const at::Tensor& on_host,
                                 const at::Tensor& entry_request, const at::Tensor& entry_slot,
                                 const at::Tensor& slot_rows, at::Tensor& kv_rows,
                                 const at::Tensor& copy_rows, const at::Tensor& host_rows,
                                 const at::Tensor& load, const at::Tensor& load_request,
                                 const at::Tensor& load_slot, const at::Tensor& load_host_row,
                                 at::Tensor& error, int64_t block_stride_rows, int64_t block_rows) {
  check_apply_resolution(rows, on_host, entry_request, entry_slot, slot_rows, kv_rows, copy_rows,
                         host_rows, load, load_request, load_slot, load_host_row, error,
                         block_stride_rows, block_rows);
  return at::empty_like(rows);
}

at::Tensor apply_resolution_cuda(const at::Tensor& rows, const at::Tensor& on_host,
                                 const at::Tensor& entry_request, const at::Tensor& entry_slot,
                                 const at::Tensor& slot_rows, at::Tensor& kv_rows,
                                 const at::Tensor& copy_rows, const at::Tensor& host_rows,
                                 const at::Tensor& load, const at::Tensor& load_request,
                                 const at::Tensor& load_slot, const at::Tensor& load_host_row,
                                 at::Tensor& error, int64_t block_stride_rows, int64_t block_rows) {
  check_apply_resolution(rows, on_host, entry_request, entry_slot, slot_rows, kv_rows, copy_rows,
                         host_rows, load, load_request, load_slot, load_host_row, error,
                         block_stride_rows, block_rows);
  TORCH_CHECK(kv_rows.is_cuda(), "kv_rows must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(kv_rows.device());
  at::Tensor resolved = at::empty_like(rows);
  hisparse::ApplyArgs args{};
  args.rows = rows.data_ptr();
  args.resolved = resolved.data_ptr();
  args.on_host = on_host.data_ptr<bool>();
  args.entry_request = entry_request.data_ptr<int64_t>();
  args.entry_slot = entry_slot.data_ptr<int64_t>();
  args.load = load.data_ptr<bool>();
  args.load_request = load_request.data_ptr<int64_t>();
  args.load_slot = load_slot.data_ptr<int64_t>();
  args.load_host_row = load_host_row.data_ptr<int64_t>();
  args.n = rows.numel();
  args.rows_int64 = rows.scalar_type() == at::kLong;
  args.slot_rows = slot_rows.data_ptr<int64_t>();
  args.copy_rows = copy_rows.data_ptr<int64_t>();
  args.num_slot_rows = slot_rows.numel();
  args.slot_width = slot_rows.size(1);
  args.layer = row_copy_layer(kv_rows, host_rows, block_stride_rows, block_rows);
  args.error = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
  if (args.n > 0 && !hisparse::row_copy_in_words(args.layer)) {
    note_narrow_copies("resolver replay: rows", args.layer.row_bytes);
  }
  C10_CUDA_CHECK(hisparse::launch_apply_resolution(args, c10::cuda::getCurrentCUDAStream()));
  return resolved;
}

at::Tensor apply_resolution_cpu(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                at::Tensor&, int64_t, int64_t) {
  TORCH_CHECK(false,
              "_hisparse_C::apply_resolution is the CUDA kernel and needs CUDA tensors; for CPU "
              "tensors call the torch reference, vllm.v1.hisparse.resolver.apply_resolution");
}

// kv_caches[l]: layer l's cache [num_blocks, block_size, width], contiguous pages (blocks may
// stride further apart); host_pool: [num_layers, host_pages, block_size, width] contiguous;
// block_ids: int64 [num_pages, num_layers]; host_pages: int64 [num_pages]; error: int64 [1].
void check_copy_pages(const at::TensorList kv_caches, const at::Tensor& host_pool,
                      const at::Tensor& block_ids, const at::Tensor& host_pages,
                      const at::Tensor& error) {
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(num_layers > 0, "kv_caches is empty");
  TORCH_CHECK(host_pool.dim() == 4 && host_pool.is_contiguous() && host_pool.size(0) == num_layers,
              "host_pool must be a contiguous [", num_layers,
              ", host_pages, block_size, width] tensor, got ", host_pool.sizes());
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor& cache = kv_caches[l];
    TORCH_CHECK(cache.dim() == 3 && cache.size(1) == host_pool.size(2) &&
                    cache.size(2) == host_pool.size(3),
                "KV cache of layer ", l, " is ", cache.sizes(), "; pages must be [",
                host_pool.size(2), ", ", host_pool.size(3), "] like the host pool's");
    TORCH_CHECK(cache.scalar_type() == host_pool.scalar_type(), "KV cache of layer ", l, " is ",
                cache.scalar_type(), ", the host pool ", host_pool.scalar_type());
    TORCH_CHECK(cache.stride(2) == 1 && cache.stride(1) == cache.size(2), "KV cache of layer ", l,
                " must have contiguous pages");
    check_same_device(cache, kv_caches[0], "a KV cache");
  }
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 2 &&
                  block_ids.is_contiguous() && block_ids.size(1) == num_layers,
              "block_ids must be a contiguous int64 [num_pages, ", num_layers, "] tensor, got ",
              block_ids.sizes());
  check_index(host_pages, "host_pages");
  TORCH_CHECK(host_pages.numel() == block_ids.size(0), "block_ids has ", block_ids.size(0),
              " pages, host_pages ", host_pages.numel());
  check_error_word(error);
  for (const auto* t : {&block_ids, &host_pages, &error})
    check_same_device(*t, kv_caches[0], "an index");
}

void copy_pages_meta(at::TensorList kv_caches, at::Tensor& host_pool, const at::Tensor& block_ids,
                     const at::Tensor& host_pages, bool, at::Tensor& error) {
  check_copy_pages(kv_caches, host_pool, block_ids, host_pages, error);
}

void copy_pages_cuda(at::TensorList kv_caches, at::Tensor& host_pool, const at::Tensor& block_ids,
                     const at::Tensor& host_pages, bool to_host, at::Tensor& error) {
  check_copy_pages(kv_caches, host_pool, block_ids, host_pages, error);
  TORCH_CHECK(kv_caches[0].is_cuda(), "kv_caches must be CUDA tensors");
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  const int64_t element = host_pool.element_size();
  // Per layer: block 0's device address, the bytes between blocks, the number of blocks.
  auto layers =
      at::empty({3, num_layers}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* host_layers = layers.data_ptr<int64_t>();
  bool device_aligned16 = true;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor& cache = kv_caches[l];
    host_layers[l] = reinterpret_cast<int64_t>(cache.data_ptr());
    host_layers[num_layers + l] = cache.stride(0) * element;
    host_layers[2 * num_layers + l] = cache.size(0);
    device_aligned16 =
        device_aligned16 && host_layers[l] % 16 == 0 && host_layers[num_layers + l] % 16 == 0;
  }
  const c10::cuda::CUDAGuard guard(kv_caches[0].device());
  const auto device_layers = layers.to(kv_caches[0].device(), /*non_blocking=*/true);
  const void* host_ptr = mapped_host_pointer(host_pool, "host_pool");

  hisparse::PageCopyArgs args{};
  args.layer_base = device_layers.data_ptr<int64_t>();
  args.layer_block_stride = args.layer_base + num_layers;
  args.layer_num_blocks = args.layer_base + 2 * num_layers;
  args.host_pool = static_cast<char*>(const_cast<void*>(host_ptr));
  args.host_layer_stride = host_pool.stride(0) * element;
  args.host_page_stride = host_pool.stride(1) * element;
  args.num_host_pages = host_pool.size(1);
  args.block_ids = block_ids.data_ptr<int64_t>();
  args.host_pages = host_pages.data_ptr<int64_t>();
  args.num_pages = host_pages.numel();
  args.num_layers = num_layers;
  args.page_bytes = host_pool.size(2) * host_pool.size(3) * element;
  args.to_host = to_host;
  args.device_aligned16 = device_aligned16;
  args.error = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
  if (args.num_pages > 0 && !hisparse::page_copy_in_words(args)) {
    note_narrow_copies("page copy: pages", args.page_bytes);
  }
  C10_CUDA_CHECK(hisparse::launch_copy_pages(args, c10::cuda::getCurrentCUDAStream()));
}

void copy_pages_cpu(at::TensorList, at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                    at::Tensor&) {
  TORCH_CHECK(false,
              "_hisparse_C::copy_pages is the CUDA kernel and needs CUDA tensors; for CPU tensors "
              "call the torch reference, vllm.v1.hisparse.page_copy.copy_pages");
}

bool power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

// positions: int32 [T, K]; token_requests: int64 [T]; host_page_table: int64 [R, P];
// table_rows, staging_slots: int64 [M]; hot_positions, hot_stamps: int64 [M, H];
// flags: bool [2, T * K]; ints: int64 [5 * T * K + 4 + M] (see resolver.fused_plan_buffers).
void check_plan(const at::Tensor& positions, const at::Tensor& token_requests,
                const at::Tensor& host_page_table, const at::Tensor& table_rows,
                const at::Tensor& staging_slots, const at::Tensor& hot_positions,
                const at::Tensor& hot_stamps, int64_t block_size, int64_t max_entries,
                int64_t hot_pad, const at::Tensor& flags, const at::Tensor& ints) {
  TORCH_CHECK(
      positions.scalar_type() == at::kInt && positions.dim() == 2 && positions.is_contiguous(),
      "positions must be a contiguous int32 [T, K] tensor, got ", positions.sizes(), " ",
      positions.scalar_type());
  const int64_t tokens = positions.size(0), topk = positions.size(1);
  TORCH_CHECK(topk > 0, "positions must select at least one row per token (top-K > 0), got [",
              tokens, ", ", topk, "]");
  check_index(token_requests, "token_requests");
  TORCH_CHECK(token_requests.numel() == tokens, "token_requests must have one entry per token");
  TORCH_CHECK(host_page_table.scalar_type() == at::kLong && host_page_table.dim() == 2 &&
                  host_page_table.is_contiguous() && host_page_table.size(0) > 0,
              "host_page_table must be a contiguous int64 [R, P] tensor with R > 0");
  check_index(table_rows, "table_rows");
  check_index(staging_slots, "staging_slots");
  for (const auto* hot : {&hot_positions, &hot_stamps}) {
    TORCH_CHECK(hot->scalar_type() == at::kLong && hot->dim() == 2 && hot->is_contiguous() &&
                    hot->sizes() == hot_positions.sizes() && hot->size(0) == table_rows.numel(),
                "hot_positions and hot_stamps must be contiguous int64 [M, H] tensors, M = "
                "table_rows' size");
  }
  TORCH_CHECK(staging_slots.numel() == table_rows.numel(),
              "staging_slots must have one entry per request");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  TORCH_CHECK(
      power_of_two(max_entries) && max_entries >= topk && max_entries <= hisparse::kPlanMaxEntries,
      "max_entries must be a power of two in [top-K, ", hisparse::kPlanMaxEntries, "], got ",
      max_entries);
  TORCH_CHECK(power_of_two(hot_pad) && hot_pad >= hot_positions.size(1) &&
                  hot_pad <= hisparse::kPlanMaxHotRows,
              "hot_pad must be a power of two in [H, ", hisparse::kPlanMaxHotRows, "], got ",
              hot_pad);
  TORCH_CHECK(flags.scalar_type() == at::kBool && flags.is_contiguous() &&
                  flags.numel() == 2 * tokens * topk,
              "flags must be a contiguous bool [2, T * K] tensor");
  TORCH_CHECK(ints.scalar_type() == at::kLong && ints.is_contiguous() &&
                  ints.numel() == 5 * tokens * topk + 4 + table_rows.numel(),
              "ints must be a contiguous int64 [5 * T * K + 4 + M] tensor");
  for (const auto* t : {&token_requests, &host_page_table, &table_rows, &staging_slots,
                        &hot_positions, &hot_stamps, &flags, &ints}) {
    check_same_device(*t, positions, "a plan tensor");
  }
}

void plan_resolution_meta(const at::Tensor& positions, const at::Tensor& token_requests,
                          const at::Tensor& host_page_table, const at::Tensor& table_rows,
                          const at::Tensor& staging_slots, at::Tensor& hot_positions,
                          at::Tensor& hot_stamps, int64_t block_size, int64_t, int64_t max_entries,
                          int64_t hot_pad, at::Tensor& flags, at::Tensor& ints) {
  check_plan(positions, token_requests, host_page_table, table_rows, staging_slots, hot_positions,
             hot_stamps, block_size, max_entries, hot_pad, flags, ints);
}

void plan_resolution_cuda(const at::Tensor& positions, const at::Tensor& token_requests,
                          const at::Tensor& host_page_table, const at::Tensor& table_rows,
                          const at::Tensor& staging_slots, at::Tensor& hot_positions,
                          at::Tensor& hot_stamps, int64_t block_size, int64_t step,
                          int64_t max_entries, int64_t hot_pad, at::Tensor& flags,
                          at::Tensor& ints) {
  check_plan(positions, token_requests, host_page_table, table_rows, staging_slots, hot_positions,
             hot_stamps, block_size, max_entries, hot_pad, flags, ints);
  TORCH_CHECK(positions.is_cuda(), "positions must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t entries = positions.numel();
  hisparse::PlanArgs args{};
  args.positions = positions.data_ptr<int32_t>();
  args.token_requests = token_requests.data_ptr<int64_t>();
  args.host_page_table = host_page_table.data_ptr<int64_t>();
  args.table_rows = table_rows.data_ptr<int64_t>();
  args.hot_positions = hot_positions.data_ptr<int64_t>();
  args.hot_stamps = hot_stamps.data_ptr<int64_t>();
  args.staging_slots = staging_slots.data_ptr<int64_t>();
  args.num_tokens = positions.size(0);
  args.topk = positions.size(1);
  args.num_requests = table_rows.numel();
  args.hot_rows = hot_positions.size(1);
  args.table_height = host_page_table.size(0);
  args.num_pages = host_page_table.size(1);
  args.block_size = block_size;
  args.step = step;
  args.max_entries = max_entries;
  args.hot_pad = hot_pad;
  bool* flag = flags.data_ptr<bool>();
  int64_t* value = ints.data_ptr<int64_t>();
  args.on_host = flag;
  args.load = flag + entries;
  args.entry_request = value;
  args.entry_slot = value + entries;
  args.load_request = value + 2 * entries;
  args.load_slot = value + 3 * entries;
  args.load_host_row = value + 4 * entries;
  args.counts = value + 5 * entries;
  args.error = reinterpret_cast<unsigned long long*>(value + 5 * entries + 3);
  args.request_error = reinterpret_cast<unsigned long long*>(value + 5 * entries + 4);
  C10_CUDA_CHECK(hisparse::launch_plan(args, c10::cuda::getCurrentCUDAStream()));
}

void plan_resolution_cpu(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, at::Tensor&, at::Tensor&, int64_t, int64_t, int64_t,
                         int64_t, at::Tensor&, at::Tensor&) {
  TORCH_CHECK(
      false,
      "_hisparse_C::plan_resolution is the CUDA kernel and needs CUDA tensors; for CPU tensors "
      "call the torch reference, vllm.v1.hisparse.resolver.plan_resolution");
}

}  // namespace

TORCH_LIBRARY(_hisparse_C, m) {
  m.def(
      "copy_host_rows(Tensor(a!) kv_rows, Tensor dst_rows, Tensor host_rows, Tensor src_rows, "
      "Tensor copy, Tensor(b!) error, int block_stride_rows, int block_rows) -> ()");
  m.def(
      "copy_pages(Tensor(a!)[] kv_caches, Tensor(b!) host_pool, Tensor block_ids, Tensor "
      "host_pages, "
      "bool to_host, Tensor(c!) error) -> ()");
  m.def(
      "plan_resolution(Tensor positions, Tensor token_requests, Tensor host_page_table, Tensor "
      "table_rows, "
      "Tensor staging_slots, Tensor(a!) hot_positions, Tensor(b!) hot_stamps, int block_size, int "
      "step, "
      "int max_entries, int hot_pad, Tensor(c!) flags, Tensor(d!) ints) -> ()");
  m.def(
      "apply_resolution(Tensor rows, Tensor on_host, Tensor entry_request, Tensor entry_slot, "
      "Tensor slot_rows, Tensor(a!) kv_rows, Tensor copy_rows, Tensor host_rows, Tensor load, "
      "Tensor load_request, Tensor load_slot, Tensor load_host_row, Tensor(b!) error, "
      "int block_stride_rows, int block_rows) -> Tensor");
  // No tensor arguments, so no dispatch key: one kernel serves every caller.
  m.def("narrow_copy_launches() -> int", &narrow_copy_launches);
}

TORCH_LIBRARY_IMPL(_hisparse_C, CUDA, m) {
  m.impl("apply_resolution", &apply_resolution_cuda);
  m.impl("copy_host_rows", &copy_host_rows_cuda);
  m.impl("copy_pages", &copy_pages_cuda);
  m.impl("plan_resolution", &plan_resolution_cuda);
}

TORCH_LIBRARY_IMPL(_hisparse_C, Meta, m) {
  m.impl("apply_resolution", &apply_resolution_meta);
  m.impl("copy_host_rows", &copy_host_rows_meta);
  m.impl("copy_pages", &copy_pages_meta);
  m.impl("plan_resolution", &plan_resolution_meta);
}

TORCH_LIBRARY_IMPL(_hisparse_C, CPU, m) {
  m.impl("apply_resolution", &apply_resolution_cpu);
  m.impl("copy_host_rows", &copy_host_rows_cpu);
  m.impl("copy_pages", &copy_pages_cpu);
  m.impl("plan_resolution", &plan_resolution_cpu);
}
