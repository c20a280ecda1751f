// SPDX-License-Identifier: Apache-2.0
// Torch binding of the HiSparse CUDA kernels: registers torch.ops._hisparse_C.*.
// Shapes and dtypes are validated in Python (vllm/v1/hisparse/resolver.py, page_copy.py);
// here only what the kernel itself relies on is checked.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "hisparse_page_copy.h"
#include "hisparse_row_copy.h"

namespace {

void check_cuda_long(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// kv_rows: CUDA [rows, width] (any row stride); host_rows: pinned [rows, width], same
// element size; dst_rows / src_rows: CUDA int64 [n]; copy: CUDA bool [n].
void copy_host_rows(at::Tensor& kv_rows, const at::Tensor& dst_rows, const at::Tensor& host_rows,
                    const at::Tensor& src_rows, const at::Tensor& copy) {
  TORCH_CHECK(kv_rows.is_cuda() && kv_rows.dim() == 2 && kv_rows.stride(1) == 1,
              "kv_rows must be CUDA rows [rows, width] with contiguous columns");
  TORCH_CHECK(host_rows.is_pinned() && host_rows.dim() == 2 && host_rows.stride(1) == 1,
              "host_rows must be pinned host rows [rows, width] with contiguous columns");
  TORCH_CHECK(kv_rows.size(1) * kv_rows.element_size() == host_rows.size(1) * host_rows.element_size(),
              "kv_rows and host_rows rows differ in bytes");
  check_cuda_long(dst_rows, "dst_rows");
  check_cuda_long(src_rows, "src_rows");
  TORCH_CHECK(copy.is_cuda() && copy.scalar_type() == at::kBool && copy.is_contiguous(),
              "copy must be a contiguous CUDA bool tensor");
  TORCH_CHECK(dst_rows.numel() == src_rows.numel() && copy.numel() == dst_rows.numel(),
              "dst_rows, src_rows and copy must have one entry each");
  const c10::cuda::CUDAGuard guard(kv_rows.device());
  void* host_ptr = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&host_ptr, host_rows.data_ptr(), 0));
  hisparse::RowCopyArgs args{};
  args.kv_rows = static_cast<char*>(kv_rows.data_ptr());
  args.kv_row_stride = kv_rows.stride(0) * kv_rows.element_size();
  args.host_rows = static_cast<const char*>(host_ptr);
  args.host_row_stride = host_rows.stride(0) * host_rows.element_size();
  args.dst_rows = dst_rows.data_ptr<int64_t>();
  args.src_rows = src_rows.data_ptr<int64_t>();
  args.copy = copy.data_ptr<bool>();
  args.n = dst_rows.numel();
  args.row_bytes = kv_rows.size(1) * kv_rows.element_size();
  C10_CUDA_CHECK(hisparse::launch_copy_host_rows(args, c10::cuda::getCurrentCUDAStream()));
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
      "copy_host_rows(Tensor(a!) kv_rows, Tensor dst_rows, Tensor host_rows, Tensor src_rows, "
      "Tensor copy) -> ()");
  m.def(
      "copy_pages(Tensor layer_base, Tensor layer_block_stride, int page_bytes, "
      "Tensor(a!) host_pool, int host_layer_stride, int host_page_stride, Tensor block_ids, "
      "Tensor host_pages, bool to_host) -> ()");
}

TORCH_LIBRARY_IMPL(_hisparse_C, CUDA, m) {
  m.impl("copy_host_rows", &copy_host_rows);
  m.impl("copy_pages", &copy_pages);
}
