#include <fmt/ranges.h>
#include <pagedattn/tensor.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <span>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pagedattn {
namespace {

constexpr std::size_t kCpuAlignment = 64;  // cache line; also enough for any SIMD load
constexpr int kNumDeviceTypes = 2;         // DeviceType::CPU, DeviceType::CUDA

constexpr std::string_view kViewWhere = "TensorView";

// Normalizes a possibly negative dimension index against `rank`; throws when out of range.
int normalize_dim(int d, int rank, std::string_view where) {
  const int nd = d < 0 ? d + rank : d;
  if (nd < 0 || nd >= rank) {
    throw_invalid(where, "dim", fmt::format("in [{}, {})", -rank, rank), fmt::format("{}", d));
  }
  return nd;
}

Dims contiguous_strides(const Dims& shape) {
  Dims strides;
  for (int i = 0; i < shape.size(); ++i) strides.push_back(0);
  std::int64_t running = 1;
  for (int i = shape.size() - 1; i >= 0; --i) {
    strides[i] = running;
    running *= std::max<std::int64_t>(shape[i], 1);
  }
  return strides;
}

std::int64_t product(const Dims& shape) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return n;
}

// Walks the elements of `shape` in row-major order, calling fn(offset_a,
// offset_b) with each element's offsets under two stride sets (one view, or
// the two sides of a copy).
template <typename Fn>
void for_each_offset_pair(const Dims& shape, const Dims& strides_a, const Dims& strides_b, Fn&& fn) {
  const int rank = shape.size();
  if (rank == 0 || product(shape) == 0) return;
  std::array<std::int64_t, kMaxTensorDims> index{};
  const std::int64_t inner = shape[rank - 1];
  while (true) {
    std::int64_t base_a = 0;
    std::int64_t base_b = 0;
    for (int d = 0; d + 1 < rank; ++d) {
      base_a += index[static_cast<std::size_t>(d)] * strides_a[d];
      base_b += index[static_cast<std::size_t>(d)] * strides_b[d];
    }
    for (std::int64_t i = 0; i < inner; ++i)
      fn(base_a + i * strides_a[rank - 1], base_b + i * strides_b[rank - 1]);
    int d = rank - 2;
    for (; d >= 0; --d) {
      auto& id = index[static_cast<std::size_t>(d)];
      if (++id < shape[d]) break;
      id = 0;
    }
    if (d < 0) return;
  }
}

template <typename Fn>
void for_each_offset(const TensorView& t, Fn&& fn) {
  for_each_offset_pair(t.shape(), t.strides(), t.strides(), [&](std::int64_t off, std::int64_t) { fn(off); });
}

// torch's stride computation for view(): returns the strides expressing
// `new_shape` over the same memory, or nullopt when the layout cannot.
std::optional<Dims> view_strides(const Dims& old_shape, const Dims& old_strides, const Dims& new_shape) {
  if (product(old_shape) == 0) {
    if (old_shape == new_shape) return old_strides;
    return contiguous_strides(new_shape);
  }
  Dims new_strides = new_shape;  // every entry is overwritten below
  int view_d = new_shape.size() - 1;
  std::int64_t chunk_base_stride = old_strides[old_shape.size() - 1];
  std::int64_t tensor_numel = 1;
  std::int64_t view_numel = 1;
  for (int tensor_d = old_shape.size() - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= old_shape[tensor_d];
    // A chunk ends where the next-outer dimension is not laid out right after this one.
    const bool chunk_ends = tensor_d == 0 || (old_shape[tensor_d - 1] != 1 &&
                                              old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride);
    if (!chunk_ends) continue;
    while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
      new_strides[view_d] = view_numel * chunk_base_stride;
      view_numel *= new_shape[view_d];
      --view_d;
    }
    if (view_numel != tensor_numel) return std::nullopt;
    if (tensor_d > 0) {
      chunk_base_stride = old_strides[tensor_d - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

// ---- the built-in CPU allocator --------------------------------------------

void require_cpu(Device d, std::string_view where) {
  if (!d.is_cpu()) {
    throw Error(ErrorKind::Unsupported,
                fmt::format("{}: the CPU allocator cannot reach device {}", where, d));
  }
}

// Allocations of at least one huge page (KV caches, large activations) are
// aligned to it and offered to transparent huge pages: the paged KV cache is
// read block by block in an order the page table does not predict, and with
// 4 KiB pages every block costs a TLB miss, which a virtual machine's nested
// page walk makes slow (`8q1s8k` ~10% faster on huge pages on a 2-core VM).
constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

std::size_t cpu_alignment(std::size_t bytes) {
  return bytes >= kHugePageBytes ? kHugePageBytes : kCpuAlignment;
}

class CpuAllocator final : public DeviceAllocator {
 public:
  void* allocate(std::size_t bytes, Device d) override {
    require_cpu(d, "CpuAllocator::allocate");
    const std::size_t alignment = cpu_alignment(bytes);
    // Rounded up (aligned_alloc wants whole alignments) so a zero-byte request
    // still yields a unique, freeable pointer.
    const std::size_t rounded = std::max(alignment, (bytes + alignment - 1) / alignment * alignment);
    void* p = rounded < bytes ? nullptr : std::aligned_alloc(alignment, rounded);
    if (p == nullptr) {
      throw Error(ErrorKind::OutOfMemory,
                  fmt::format("CpuAllocator::allocate: cannot allocate {} bytes", bytes));
    }
#if defined(__linux__)
    // Advice only: where THP is off (or the kernel refuses) the pages stay 4 KiB.
    if (alignment == kHugePageBytes) madvise(p, rounded, MADV_HUGEPAGE);
#endif
    return p;
  }
  void deallocate(void* p, Device /*d*/) noexcept override { std::free(p); }
  void copy(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t bytes) override {
    require_cpu(dst_dev, "CpuAllocator::copy");
    require_cpu(src_dev, "CpuAllocator::copy");
    if (bytes > 0) std::memmove(dst, src, bytes);
  }
  void memset(void* dst, Device d, int value, std::size_t bytes) override {
    require_cpu(d, "CpuAllocator::memset");
    if (bytes > 0) std::memset(dst, value, bytes);
  }
  int device_count() const override { return 1; }
  DeviceCapability capability(Device /*d*/) const override { return {}; }
};

// Function-local statics so the registry works during other translation
// units' static initialization (where device modules register themselves).
std::array<std::atomic<DeviceAllocator*>, kNumDeviceTypes>& allocator_registry() {
  static CpuAllocator cpu;
  static std::array<std::atomic<DeviceAllocator*>, kNumDeviceTypes> registry{&cpu, nullptr};
  return registry;
}

std::size_t type_slot(DeviceType type) { return static_cast<std::size_t>(type); }

void check_device_index(Device d, std::string_view where) {
  DeviceAllocator& alloc = device_allocator(d.type);
  const int count = alloc.device_count();
  if (d.index < 0 || d.index >= count) {
    throw_invalid(where, "device index", fmt::format("in [0, {}) for {}", count, device_type_name(d.type)),
                  fmt::format("{}", d.index));
  }
}

void check_shape(const Dims& shape, std::string_view where) {
  if (shape.size() == 0) throw_invalid(where, "shape rank", fmt::format("in [1, {}]", kMaxTensorDims), "0");
  for (std::int64_t s : shape) {
    if (s < 0) throw_invalid(where, "shape", "non-negative", shape.str());
  }
}

// Allocator that moves bytes between `a` and `b`: the non-CPU side's, if any.
DeviceAllocator& copy_allocator(Device a, Device b) {
  if (!a.is_cpu()) return device_allocator(a.type);
  return device_allocator(b.type);
}

// Whether the view's elements are exactly the bytes it spans: a permutation
// of a contiguous layout (size-1 dimensions ignored), with no gap or overlap.
bool fills_its_span(const TensorView& t) {
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size) of the dims that step
  for (int i = 0; i < t.dim(); ++i) {
    if (t.size(i) != 1) dims.emplace_back(t.stride(i), t.size(i));
  }
  std::sort(dims.begin(), dims.end());
  std::int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

// Host copy of the bytes a view spans (starting at data()).
std::vector<std::uint8_t> stage_to_host(const TensorView& t) {
  std::vector<std::uint8_t> host(t.span_bytes());
  device_allocator(t.device().type).copy(host.data(), Device::cpu(), t.data(), t.device(), host.size());
  return host;
}

// Copies element bytes between two host-addressable views of equal shape.
void copy_host_elements(const TensorView& dst, const TensorView& src) {
  const auto es = static_cast<std::int64_t>(src.element_size());
  auto* d = static_cast<std::uint8_t*>(dst.data());
  const auto* s = static_cast<const std::uint8_t*>(src.data());
  for_each_offset_pair(dst.shape(), dst.strides(), src.strides(),
                       [&](std::int64_t dst_off, std::int64_t src_off) {
                         std::memcpy(d + dst_off * es, s + src_off * es, static_cast<std::size_t>(es));
                       });
}

TensorView with_data(const TensorView& t, void* data, Device device) {
  return TensorView(data, t.dtype(), device, t.shape(), t.strides());
}

}  // namespace

// ---- Dims -------------------------------------------------------------------

Dims::Dims(std::initializer_list<std::int64_t> v)
    : Dims(std::span<const std::int64_t>(v.begin(), v.size())) {}

Dims::Dims(std::span<const std::int64_t> v) {
  for (std::int64_t x : v) push_back(x);
}

void Dims::push_back(std::int64_t x) {
  if (n_ >= kMaxTensorDims) {
    throw_invalid("Dims", "rank", fmt::format("at most {}", kMaxTensorDims), fmt::format("{}", n_ + 1));
  }
  v_[static_cast<std::size_t>(n_++)] = x;
}

bool operator==(const Dims& a, const Dims& b) { return std::ranges::equal(a.span(), b.span()); }

std::string Dims::str() const { return fmt::format("[{}]", fmt::join(span(), ", ")); }

// ---- TensorView ---------------------------------------------------------------

TensorView::TensorView(void* data, DType dtype, Device device, Dims shape, Dims strides)
    : data_(data), dtype_(dtype), device_(device), shape_(shape), strides_(strides) {
  if (shape.size() != strides.size()) {
    throw_invalid(kViewWhere, "strides rank", fmt::format("{} (the shape's rank)", shape.size()),
                  fmt::format("{}", strides.size()));
  }
  for (int i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) throw_invalid(kViewWhere, "shape", "non-negative", shape.str());
    if (strides[i] < 0) throw_invalid(kViewWhere, "strides", "non-negative", strides.str());
  }
}

TensorView::TensorView(void* data, DType dtype, Device device, Dims shape)
    : TensorView(data, dtype, device, shape, contiguous_strides(shape)) {}

std::int64_t TensorView::size(int d) const { return shape_[normalize_dim(d, dim(), "TensorView::size")]; }

std::int64_t TensorView::stride(int d) const {
  return strides_[normalize_dim(d, dim(), "TensorView::stride")];
}

std::int64_t TensorView::numel() const { return defined() ? product(shape_) : 0; }

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;
  std::int64_t expected = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (shape_[i] == 1) continue;  // the stride of a size-1 dimension is never used
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

std::size_t TensorView::span_bytes() const {
  if (numel() == 0) return 0;
  std::int64_t last = 0;
  for (int i = 0; i < dim(); ++i) last += (shape_[i] - 1) * strides_[i];
  return static_cast<std::size_t>(last + 1) * element_size();
}

void* TensorView::element_ptr(std::span<const std::int64_t> index) const {
  check_arg(static_cast<int>(index.size()) == dim(), "TensorView::element_ptr", "index rank", dim(),
            index.size());
  std::int64_t offset = 0;
  for (int i = 0; i < dim(); ++i) offset += index[static_cast<std::size_t>(i)] * strides_[i];
  return static_cast<std::uint8_t*>(data_) + offset * static_cast<std::int64_t>(element_size());
}

TensorView TensorView::select(int d, std::int64_t index) const {
  constexpr std::string_view where = "TensorView::select";
  const int nd = normalize_dim(d, dim(), where);
  const std::int64_t n = shape_[nd];
  const std::int64_t i = index < 0 ? index + n : index;
  if (i < 0 || i >= n)
    throw_invalid(where, "index", fmt::format("in [{}, {})", -n, n), fmt::format("{}", index));
  if (dim() == 1) {
    throw_invalid(where, "tensor rank", "at least 2 (rank-0 views stand for no tensor)", "1");
  }
  Dims shape;
  Dims strides;
  for (int k = 0; k < dim(); ++k) {
    if (k == nd) continue;
    shape.push_back(shape_[k]);
    strides.push_back(strides_[k]);
  }
  void* p = static_cast<std::uint8_t*>(data_) + i * strides_[nd] * static_cast<std::int64_t>(element_size());
  return TensorView(p, dtype_, device_, shape, strides);
}

TensorView TensorView::slice(int d, std::int64_t start, std::int64_t end) const {
  constexpr std::string_view where = "TensorView::slice";
  const int nd = normalize_dim(d, dim(), where);
  const std::int64_t n = shape_[nd];
  if (start < 0 || start > end || end > n) {
    throw_invalid(where, "range", fmt::format("0 <= start <= end <= {}", n),
                  fmt::format("[{}, {})", start, end));
  }
  Dims shape = shape_;
  shape[nd] = end - start;
  void* p =
      static_cast<std::uint8_t*>(data_) + start * strides_[nd] * static_cast<std::int64_t>(element_size());
  return TensorView(p, dtype_, device_, shape, strides_);
}

TensorView TensorView::permute(std::span<const int> order) const {
  const auto reject = [&] {
    throw_invalid("TensorView::permute", "order", fmt::format("a permutation of {} dimensions", dim()),
                  fmt::format("[{}]", fmt::join(order, ", ")));
  };
  if (static_cast<int>(order.size()) != dim()) reject();
  std::array<bool, kMaxTensorDims> seen{};
  Dims shape;
  Dims strides;
  for (int o : order) {
    if (o < 0 || o >= dim() || seen[static_cast<std::size_t>(o)]) reject();
    seen[static_cast<std::size_t>(o)] = true;
    shape.push_back(shape_[o]);
    strides.push_back(strides_[o]);
  }
  return TensorView(data_, dtype_, device_, shape, strides);
}

TensorView TensorView::view(Dims new_shape) const {
  constexpr std::string_view where = "TensorView::view";
  if (!defined()) throw_invalid(where, "tensor", "defined", "an undefined view");
  if (new_shape.size() == 0)
    throw_invalid(where, "shape rank", fmt::format("in [1, {}]", kMaxTensorDims), "0");
  const std::int64_t n = numel();
  int inferred = -1;
  std::int64_t known = 1;
  for (int i = 0; i < new_shape.size(); ++i) {
    if (new_shape[i] == -1) {
      if (inferred >= 0) throw_invalid(where, "shape", "at most one -1 entry", new_shape.str());
      inferred = i;
    } else if (new_shape[i] < 0) {
      throw_invalid(where, "shape", "non-negative or -1", new_shape.str());
    } else {
      known *= new_shape[i];
    }
  }
  if (inferred >= 0) {
    if (known == 0 || n % known != 0) {
      throw_invalid(where, "shape", fmt::format("compatible with {} elements", n), new_shape.str());
    }
    new_shape[inferred] = n / known;
  }
  if (product(new_shape) != n) {
    throw_invalid(where, "shape", fmt::format("of {} elements (from {})", n, shape_.str()), new_shape.str());
  }
  const std::optional<Dims> strides = view_strides(shape_, strides_, new_shape);
  if (!strides) {
    throw_invalid(where, "shape",
                  fmt::format("expressible over strides {} of shape {}", strides_.str(), shape_.str()),
                  new_shape.str());
  }
  return TensorView(data_, dtype_, device_, new_shape, *strides);
}

std::string TensorView::describe() const {
  return fmt::format("{}{} strides {} {}", dtype_, shape_.str(), strides_.str(), device_);
}

// ---- allocator registry -----------------------------------------------------

void register_device_allocator(DeviceType type, DeviceAllocator* allocator) {
  allocator_registry()[type_slot(type)].store(allocator);
}

DeviceAllocator* find_device_allocator(DeviceType type) {
  return allocator_registry()[type_slot(type)].load();
}

DeviceCapability device_capability(Device device) {
  const DeviceAllocator* allocator = find_device_allocator(device.type);
  return allocator != nullptr ? allocator->capability(device) : DeviceCapability{};
}

DeviceAllocator& device_allocator(DeviceType type) {
  DeviceAllocator* a = find_device_allocator(type);
  if (a == nullptr) {
    throw_unsupported("device_allocator",
                      fmt::format("no allocator registered for device type {} (not built, or no device)",
                                  device_type_name(type)));
  }
  return *a;
}

std::vector<Device> available_devices() {
  std::vector<Device> devices;
  for (DeviceType type : {DeviceType::CPU, DeviceType::CUDA}) {
    const DeviceAllocator* a = find_device_allocator(type);
    if (a == nullptr) continue;
    for (int i = 0; i < a->device_count(); ++i) devices.push_back(Device{type, i});
  }
  return devices;
}

// ---- Tensor -------------------------------------------------------------------

Tensor Tensor::empty(Dims shape, DType dtype, Device device) {
  constexpr std::string_view where = "Tensor::empty";
  check_shape(shape, where);
  check_device_index(device, where);
  std::size_t bytes = dtype_size(dtype);
  for (std::int64_t s : shape) {
    if (s != 0 && bytes > std::numeric_limits<std::size_t>::max() / static_cast<std::size_t>(s)) {
      throw Error(ErrorKind::OutOfMemory,
                  fmt::format("{}: shape {} overflows the address space", where, shape.str()));
    }
    bytes *= static_cast<std::size_t>(s);
  }
  DeviceAllocator& alloc = device_allocator(device.type);
  void* p = alloc.allocate(bytes, device);
  Tensor t;
  static_cast<TensorView&>(t) = TensorView(p, dtype, device, shape);
  t.storage_ = std::shared_ptr<void>(p, [&alloc, device](void* q) { alloc.deallocate(q, device); });
  return t;
}

Tensor Tensor::zeros(Dims shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  device_allocator(device.type).memset(t.data(), device, 0, t.span_bytes());
  return t;
}

namespace {

// The physical (memory-order) shape of `logical_shape` under `stride_order`,
// and the permutation that views it logically; InvalidArgument unless the
// order is a permutation of the dimensions.
struct StrideOrder {
  Dims physical;
  std::array<int, kMaxTensorDims> inverse{};
  int rank = 0;
  std::span<const int> inverse_span() const { return {inverse.data(), static_cast<std::size_t>(rank)}; }
};

StrideOrder stride_order_of(const Dims& logical_shape, std::span<const int> stride_order, std::string_view where) {
  const std::string given = fmt::format("[{}]", fmt::join(stride_order, ", "));
  StrideOrder r;
  r.rank = logical_shape.size();
  if (static_cast<int>(stride_order.size()) != r.rank) {
    throw_invalid(where, "stride_order", fmt::format("a permutation of {} dimensions", r.rank), given);
  }
  std::array<bool, kMaxTensorDims> seen{};
  for (int i = 0; i < r.rank; ++i) {
    const int o = stride_order[static_cast<std::size_t>(i)];
    if (o < 0 || o >= r.rank || seen[static_cast<std::size_t>(o)]) {
      throw_invalid(where, "stride_order", fmt::format("a permutation of {} dimensions", r.rank), given);
    }
    seen[static_cast<std::size_t>(o)] = true;
    r.physical.push_back(logical_shape[o]);
    r.inverse[static_cast<std::size_t>(o)] = i;
  }
  return r;
}

}  // namespace

Tensor Tensor::empty_strided_order(Dims logical_shape, std::span<const int> stride_order, DType dtype,
                                   Device device) {
  const StrideOrder order = stride_order_of(logical_shape, stride_order, "Tensor::empty_strided_order");
  return empty(order.physical, dtype, device).permute(order.inverse_span());
}

Tensor carve_strided_order(const Tensor& owner, std::size_t byte_offset, Dims logical_shape,
                           std::span<const int> stride_order, DType dtype) {
  constexpr std::string_view where = "carve_strided_order";
  const StrideOrder order = stride_order_of(logical_shape, stride_order, where);
  check_shape(logical_shape, where);
  const std::size_t owner_bytes = owner.defined() ? owner.span_bytes() : 0;
  std::size_t bytes = dtype_size(dtype);
  for (std::int64_t s : logical_shape) {
    check_arg(s == 0 || bytes <= std::numeric_limits<std::size_t>::max() / static_cast<std::size_t>(s), where,
              "logical_shape", "a size that fits in size_t", logical_shape.str());
    bytes *= static_cast<std::size_t>(s);
  }
  check_arg(byte_offset <= owner_bytes && bytes <= owner_bytes - byte_offset, where, "region",
            fmt::format("within the owner's {} bytes", owner_bytes),
            fmt::format("{} bytes from byte {}", bytes, byte_offset));
  const TensorView region(static_cast<unsigned char*>(owner.data()) + byte_offset, dtype, owner.device(),
                          order.physical);
  return Tensor(owner, region.permute(order.inverse_span()));
}

Tensor Tensor::from_floats(std::span<const float> values, Dims shape, DType dtype, Device device) {
  check_shape(shape, "Tensor::from_floats");
  check_arg(static_cast<std::int64_t>(values.size()) == product(shape), "Tensor::from_floats", "values size",
            fmt::format("{} (the numel of {})", product(shape), shape.str()), values.size());
  Tensor host = empty(shape, dtype, Device::cpu());
  auto* p = static_cast<std::uint8_t*>(host.data());
  for (std::size_t i = 0; i < values.size(); ++i)
    store_from_float(p + i * host.element_size(), dtype, values[i]);
  return device.is_cpu() ? host : host.to(device);
}

namespace {

template <typename T>
Tensor from_integers(std::span<const T> values, Dims shape, DType dtype, Device device,
                     std::string_view where) {
  check_shape(shape, where);
  check_arg(static_cast<std::int64_t>(values.size()) == product(shape), where, "values size",
            fmt::format("{} (the numel of {})", product(shape), shape.str()), values.size());
  Tensor host = Tensor::empty(shape, dtype, Device::cpu());
  if (!values.empty()) std::memcpy(host.data(), values.data(), values.size_bytes());
  return device.is_cpu() ? host : host.to(device);
}

}  // namespace

Tensor Tensor::from_i32(std::span<const std::int32_t> values, Dims shape, Device device) {
  return from_integers(values, shape, DType::I32, device, "Tensor::from_i32");
}

Tensor Tensor::from_i64(std::span<const std::int64_t> values, Dims shape, Device device) {
  return from_integers(values, shape, DType::I64, device, "Tensor::from_i64");
}

Tensor::Tensor(const Tensor& owner, const TensorView& view) : TensorView(view), storage_(owner.storage_) {}

Tensor Tensor::clone() const { return to(device()); }

Tensor Tensor::to(Device device) const {
  if (!defined()) return {};
  Tensor out = empty(shape(), dtype(), device);
  copy_tensor(out, *this);
  return out;
}

// ---- element-wise helpers -----------------------------------------------------

void copy_tensor(const TensorView& dst, const TensorView& src) {
  constexpr std::string_view where = "copy_tensor";
  check_arg(dst.shape() == src.shape(), where, "dst shape", src.shape().str(), dst.shape().str());
  check_dtype(dst, where, "dst", src.dtype());
  if (src.numel() == 0) return;
  if (dst.device().is_cpu() && src.device().is_cpu()) {
    if (dst.is_contiguous() && src.is_contiguous()) {
      std::memmove(dst.data(), src.data(), src.span_bytes());
    } else {
      copy_host_elements(dst, src);
    }
    return;
  }
  if (dst.is_contiguous() && src.is_contiguous()) {
    copy_allocator(dst.device(), src.device())
        .copy(dst.data(), dst.device(), src.data(), src.device(), src.span_bytes());
    return;
  }
  // Strided copies touching a device go through host images of both spans. A
  // destination with gaps (bytes inside its span that are not its elements) is
  // read back first so the gaps are written back unchanged; a gapless one is
  // not, since reading never-written device memory is what memory checkers flag.
  std::vector<std::uint8_t> src_host =
      src.device().is_cpu() ? std::vector<std::uint8_t>() : stage_to_host(src);
  const TensorView src_view = src.device().is_cpu() ? src : with_data(src, src_host.data(), Device::cpu());
  if (dst.device().is_cpu()) {
    copy_host_elements(dst, src_view);
    return;
  }
  std::vector<std::uint8_t> dst_host = fills_its_span(dst) ? std::vector<std::uint8_t>(dst.span_bytes())
                                                           : stage_to_host(dst);
  copy_host_elements(with_data(dst, dst_host.data(), Device::cpu()), src_view);
  device_allocator(dst.device().type)
      .copy(dst.data(), dst.device(), dst_host.data(), Device::cpu(), dst_host.size());
}

void fill_tensor_bits(const TensorView& dst, std::uint64_t bits) {
  if (dst.numel() == 0) return;
  const std::size_t es = dst.element_size();
  if (!dst.device().is_cpu()) {
    Tensor host = Tensor::empty(dst.shape(), dst.dtype(), Device::cpu());
    fill_tensor_bits(host, bits);
    copy_tensor(dst, host);
    return;
  }
  // Little-endian hosts: the low `es` bytes of `bits` are the element's bytes.
  auto* base = static_cast<std::uint8_t*>(dst.data());
  for_each_offset(
      dst, [&](std::int64_t off) { std::memcpy(base + off * static_cast<std::int64_t>(es), &bits, es); });
}

void fill_tensor(const TensorView& dst, float value) {
  std::uint64_t bits = 0;
  store_from_float(&bits, dst.dtype(), value);
  fill_tensor_bits(dst, bits);
}

std::vector<std::uint8_t> to_byte_vector(const TensorView& src) {
  if (src.numel() == 0) return {};
  if (!src.device().is_cpu()) {
    Tensor host = Tensor::empty(src.shape(), src.dtype(), Device::cpu());
    copy_tensor(host, src);
    return to_byte_vector(host);
  }
  const std::size_t es = src.element_size();
  std::vector<std::uint8_t> out(static_cast<std::size_t>(src.numel()) * es);
  const auto* base = static_cast<const std::uint8_t*>(src.data());
  std::size_t i = 0;
  for_each_offset(src, [&](std::int64_t off) {
    std::memcpy(out.data() + i, base + off * static_cast<std::int64_t>(es), es);
    i += es;
  });
  return out;
}

std::vector<float> to_float_vector(const TensorView& src) {
  const std::vector<std::uint8_t> bytes = to_byte_vector(src);
  const std::size_t es = src.element_size();
  std::vector<float> out(bytes.size() / es);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = load_as_float(bytes.data() + i * es, src.dtype());
  return out;
}

// ---- argument checks ------------------------------------------------------------

void check_dtype(const TensorView& t, std::string_view where, std::string_view name, DType expected) {
  if (t.dtype() != expected) {
    throw_invalid(where, fmt::format("{} dtype", name), dtype_name(expected), dtype_name(t.dtype()));
  }
}

void check_device(const TensorView& t, std::string_view where, std::string_view name, Device expected) {
  if (t.device() != expected) {
    throw_invalid(where, fmt::format("{} device", name), device_name(expected), device_name(t.device()));
  }
}

void check_rank(const TensorView& t, std::string_view where, std::string_view name, int rank) {
  if (t.dim() != rank) {
    const std::string actual =
        t.defined() ? fmt::format("{} (shape {})", t.dim(), t.shape().str()) : std::string("0 (undefined)");
    throw_invalid(where, fmt::format("{} rank", name), fmt::format("{}", rank), actual);
  }
}

void check_size(const TensorView& t, int d, std::string_view where, std::string_view name,
                std::int64_t expected) {
  if (t.size(d) != expected) {
    throw_invalid(where, fmt::format("{} size({})", name, d), fmt::format("{}", expected),
                  fmt::format("{} (shape {})", t.size(d), t.shape().str()));
  }
}

void check_shape(const TensorView& t, std::string_view where, std::string_view name, const Dims& expected,
                 std::string_view dims) {
  if (t.shape() != expected) {
    throw_invalid(where, fmt::format("{} shape", name), fmt::format("{} ({})", expected.str(), dims),
                  t.defined() ? t.shape().str() : std::string("undefined"));
  }
}

void check_last_dim_contiguous(const TensorView& t, std::string_view where, std::string_view name) {
  // The stride of a dimension of size <= 1 is never used to address memory.
  if (t.size(-1) > 1 && t.stride(-1) != 1) {
    throw_invalid(where, fmt::format("{} stride(-1)", name), "1 (last dimension contiguous)",
                  fmt::format("{}", t.stride(-1)));
  }
}

}  // namespace pagedattn
