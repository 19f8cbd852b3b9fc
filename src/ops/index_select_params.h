// The index_select op's kernel parameters from its validated front-end
// arguments. The CPU and the CUDA kernels declare the same POD fields
// (kernels include no core headers), so one template fills either.
#pragma once

#include <pagedattn/tensor.h>

#include <cstdint>

namespace pagedattn {

//   dst    [..., N, ...]  N = index.size(0) at `dim`
//   src    [..., M, ...]
//   index  [N] i32
template <typename Params>
Params index_select_params(const TensorView& dst, const TensorView& src, int dim, const TensorView& index,
                           std::uint64_t fill_bits) {
  Params p;
  p.dst = dst.data();
  p.src = src.data();
  p.index = static_cast<const std::int32_t*>(index.data());
  p.index_stride = index.stride(0);
  p.num_rows = dst.size(dim);
  p.src_rows = src.size(dim);
  p.dst_row_stride = dst.stride(dim);
  p.src_row_stride = src.stride(dim);
  int rank = 0;
  for (int d = 0; d < dst.dim(); ++d) {
    if (d == dim) continue;
    p.dst_slice.shape[rank] = dst.size(d);
    p.dst_slice.strides[rank] = dst.stride(d);
    p.src_slice_strides[rank] = src.stride(d);
    ++rank;
  }
  p.dst_slice.rank = rank;
  p.element_size = dst.element_size();
  p.fill_bits = fill_bits;
  return p;
}

}  // namespace pagedattn
