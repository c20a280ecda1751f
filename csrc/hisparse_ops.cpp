// SPDX-License-Identifier: Apache-2.0
// Torch binding of the HiSparse CUDA kernels: registers torch.ops._hisparse_C.*.
// Shapes and dtypes are validated in Python (vllm/v1/hisparse/resolver.py);
// here only what the kernel itself relies on is checked.

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "hisparse_page_copy.h"
#include "hisparse_resolver.h"

namespace {

void check_cuda_long(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

at::Tensor resolve_topk_slots(const at::Tensor& positions, const at::Tensor& req_ids,
                              const at::Tensor& page_table, at::Tensor& kv_rows,
                              const at::Tensor& host_rows, const at::Tensor& host_page_table,
                              const at::Tensor& hot_rows, at::Tensor& hot_positions,
                              at::Tensor& hot_stamps, int64_t block_size,
                              int64_t block_stride_rows, int64_t step) {
  check_cuda_long(positions, "positions");
  check_cuda_long(req_ids, "req_ids");
  check_cuda_long(page_table, "page_table");
  check_cuda_long(host_page_table, "host_page_table");
  check_cuda_long(hot_rows, "hot_rows");
  check_cuda_long(hot_positions, "hot_positions");
  check_cuda_long(hot_stamps, "hot_stamps");
  TORCH_CHECK(kv_rows.is_cuda() && kv_rows.stride(1) == 1, "kv_rows must be CUDA rows");
  TORCH_CHECK(host_rows.is_pinned() && host_rows.is_contiguous(),
              "host_rows must be contiguous pinned host memory");
  TORCH_CHECK(kv_rows.element_size() == host_rows.element_size(),
              "kv_rows and host_rows differ in element size");

  const c10::cuda::CUDAGuard guard(positions.device());
  auto out = at::empty_like(positions);
  auto error = at::zeros({1}, positions.options());
  void* host_ptr = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&host_ptr, host_rows.data_ptr(), 0));

  hisparse::ResolverArgs args{};
  args.positions = positions.data_ptr<int64_t>();
  args.req_ids = req_ids.data_ptr<int64_t>();
  args.page_table = page_table.data_ptr<int64_t>();
  args.host_page_table = host_page_table.data_ptr<int64_t>();
  args.hot_rows = hot_rows.data_ptr<int64_t>();
  args.hot_positions = hot_positions.data_ptr<int64_t>();
  args.hot_stamps = hot_stamps.data_ptr<int64_t>();
  args.out = out.data_ptr<int64_t>();
  args.error = error.data_ptr<int64_t>();
  args.num_tokens = positions.size(0);
  args.topk = positions.size(1);
  args.num_requests = page_table.size(0);
  args.num_pages = page_table.size(1);
  args.hot_slots = hot_rows.size(1);
  args.width = kv_rows.size(1);
  args.block_size = block_size;
  args.block_stride_rows = block_stride_rows;
  args.step = step;
  // kv_rows rows are strided by stride(0); the kernel indexes rows of `width`.
  TORCH_CHECK(kv_rows.stride(0) == kv_rows.size(1), "kv_rows rows must be contiguous");

  C10_CUDA_CHECK(hisparse::launch_resolve_topk_slots(
      args, kv_rows.data_ptr(), host_ptr, static_cast<int>(kv_rows.element_size()),
      c10::cuda::getCurrentCUDAStream()));
  const int64_t code = error.item<int64_t>();
  TORCH_CHECK(code != static_cast<int64_t>(hisparse::kErrorHotBufferTooSmall),
              "HotBufferTooSmall: a request selected more distinct non-resident rows in one "
              "step than its hot buffer holds; raise hisparse_config.device_buffer_size");
  TORCH_CHECK(code != static_cast<int64_t>(hisparse::kErrorNotInHostPool),
              "a selected position is neither resident nor in the host pool");
  return out;
}

// layer_base / layer_block_stride: CPU int64 [num_layers] (device addresses, bytes);
// block_ids: CUDA int64 [num_pages, num_layers]; host_pages: CUDA int64 [num_pages].
void copy_pages(const at::Tensor& layer_base, const at::Tensor& layer_block_stride,
                int64_t page_bytes, at::Tensor& host_pool, int64_t host_layer_stride,
                int64_t host_page_stride, const at::Tensor& block_ids,
                const at::Tensor& host_pages, bool to_host) {
  TORCH_CHECK(!layer_base.is_cuda() && layer_base.scalar_type() == at::kLong &&
                  layer_base.is_contiguous(),
              "layer_base must be a contiguous CPU int64 tensor");
  TORCH_CHECK(!layer_block_stride.is_cuda() && layer_block_stride.scalar_type() == at::kLong &&
                  layer_block_stride.numel() == layer_base.numel(),
              "layer_block_stride must be a CPU int64 tensor, one entry per layer");
  check_cuda_long(block_ids, "block_ids");
  check_cuda_long(host_pages, "host_pages");
  TORCH_CHECK(host_pool.is_pinned(), "host_pool must be pinned host memory");
  const int64_t num_layers = layer_base.numel();
  TORCH_CHECK(block_ids.dim() == 2 && block_ids.size(1) == num_layers &&
                  block_ids.size(0) == host_pages.numel(),
              "block_ids must be [num_pages, num_layers] and host_pages [num_pages]");

  bool device_aligned16 = true;
  const int64_t* base = layer_base.data_ptr<int64_t>();
  const int64_t* stride = layer_block_stride.data_ptr<int64_t>();
  for (int64_t l = 0; l < num_layers; ++l) {
    device_aligned16 = device_aligned16 && base[l] % 16 == 0 && stride[l] % 16 == 0;
  }
  const c10::cuda::CUDAGuard guard(block_ids.device());
  const auto device_layer_base = layer_base.to(block_ids.device());
  const auto device_layer_stride = layer_block_stride.to(block_ids.device());
  void* host_ptr = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&host_ptr, host_pool.data_ptr(), 0));

  hisparse::PageCopyArgs args{};
  args.layer_base = device_layer_base.data_ptr<int64_t>();
  args.layer_block_stride = device_layer_stride.data_ptr<int64_t>();
  args.host_pool = static_cast<char*>(host_ptr);
  args.host_layer_stride = host_layer_stride;
  args.host_page_stride = host_page_stride;
  args.block_ids = block_ids.data_ptr<int64_t>();
  args.host_pages = host_pages.data_ptr<int64_t>();
  args.num_pages = host_pages.numel();
  args.num_layers = num_layers;
  args.page_bytes = page_bytes;
  args.to_host = to_host;
  args.device_aligned16 = device_aligned16;
  C10_CUDA_CHECK(hisparse::launch_copy_pages(args, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY(_hisparse_C, m) {
  m.def(
      "resolve_topk_slots(Tensor positions, Tensor req_ids, Tensor page_table, Tensor(a!) kv_rows, "
      "Tensor host_rows, Tensor host_page_table, Tensor hot_rows, Tensor(b!) hot_positions, "
      "Tensor(c!) hot_stamps, int block_size, int block_stride_rows, int step) -> Tensor");
  m.def(
      "copy_pages(Tensor layer_base, Tensor layer_block_stride, int page_bytes, "
      "Tensor(a!) host_pool, int host_layer_stride, int host_page_stride, Tensor block_ids, "
      "Tensor host_pages, bool to_host) -> ()");
}

TORCH_LIBRARY_IMPL(_hisparse_C, CUDA, m) {
  m.impl("resolve_topk_slots", &resolve_topk_slots);
  m.impl("copy_pages", &copy_pages);
}
