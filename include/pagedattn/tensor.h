// Tensor (owning, shared storage) and TensorView (non-owning): dtype, device,
// shape and strides in elements. Views share storage; nothing here copies
// implicitly.
#pragma once

#include <pagedattn/dtype.h>
#include <pagedattn/error.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace pagedattn {

inline constexpr int kMaxTensorDims = 6;

// Shape or strides: a small fixed-capacity vector (no heap traffic on the
// forward path).
class Dims {
 public:
  Dims() = default;
  Dims(std::initializer_list<std::int64_t> v);
  explicit Dims(std::span<const std::int64_t> v);
  int size() const { return n_; }
  std::int64_t operator[](int i) const { return v_[static_cast<std::size_t>(i)]; }
  std::int64_t& operator[](int i) { return v_[static_cast<std::size_t>(i)]; }
  const std::int64_t* begin() const { return v_.data(); }
  const std::int64_t* end() const { return v_.data() + n_; }
  std::span<const std::int64_t> span() const { return {v_.data(), static_cast<std::size_t>(n_)}; }
  void push_back(std::int64_t x);
  friend bool operator==(const Dims& a, const Dims& b);
  std::string str() const;  // "[2, 3, 4]"

 private:
  std::array<std::int64_t, kMaxTensorDims> v_{};
  int n_ = 0;
};

class TensorView {
 public:
  TensorView() = default;
  // Throws InvalidArgument when shape/strides disagree in rank or exceed kMaxTensorDims.
  TensorView(void* data, DType dtype, Device device, Dims shape, Dims strides);
  // Contiguous (row-major) view.
  TensorView(void* data, DType dtype, Device device, Dims shape);

  // A default-constructed view has rank 0 and stands for "no tensor".
  bool defined() const { return shape_.size() > 0; }
  void* data() const { return data_; }
  // Typed pointer; throws InvalidArgument if sizeof(T) differs from the element size.
  template <typename T>
  T* data_as() const {
    check_arg(sizeof(T) == dtype_size(dtype_), "TensorView::data_as", "element size", dtype_size(dtype_),
              sizeof(T));
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int dim() const { return shape_.size(); }
  // Negative d counts from the end. Throws on an out-of-range dimension.
  std::int64_t size(int d) const;
  std::int64_t stride(int d) const;
  const Dims& shape() const { return shape_; }
  const Dims& strides() const { return strides_; }
  std::int64_t numel() const;
  std::size_t element_size() const { return dtype_size(dtype_); }
  bool is_contiguous() const;
  // Bytes spanned from data() to one past the last element (0 when empty).
  std::size_t span_bytes() const;

  // Pointer to the element at the given multi-index (no bounds check beyond rank).
  void* element_ptr(std::span<const std::int64_t> index) const;

  TensorView select(int d, std::int64_t index) const;
  TensorView slice(int d, std::int64_t start, std::int64_t end) const;
  TensorView permute(std::span<const int> order) const;
  TensorView permute(std::initializer_list<int> order) const {
    return permute(std::span<const int>(order.begin(), order.size()));
  }
  // Reinterprets the shape without moving data, like torch's view: throws
  // InvalidArgument when the strides cannot express the new shape. One entry
  // may be -1 (inferred).
  TensorView view(Dims new_shape) const;

  // "bf16[3, 4] strides [4, 1] cpu"
  std::string describe() const;

 protected:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Device device_{};
  Dims shape_;
  Dims strides_;
};

// Device memory hooks: CPU is built in; the CUDA module registers its own.
struct DeviceAllocator {
  virtual ~DeviceAllocator() = default;
  virtual void* allocate(std::size_t bytes, Device d) = 0;
  virtual void deallocate(void* p, Device d) noexcept = 0;
  // Copies bytes between any two devices this allocator's device type can reach.
  virtual void copy(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t bytes) = 0;
  virtual void memset(void* dst, Device d, int value, std::size_t bytes) = 0;
  virtual int device_count() const = 0;
  virtual DeviceCapability capability(Device d) const = 0;
};
void register_device_allocator(DeviceType type, DeviceAllocator* allocator);
// Throws Unsupported when no allocator is registered for the device type.
DeviceAllocator& device_allocator(DeviceType type);
// Nullptr when the device type has no registered allocator (not built, or no device).
DeviceAllocator* find_device_allocator(DeviceType type);
// The device's compute capability; {0, 0} without an allocator for its type
// (the CPU, or a build without CUDA).
DeviceCapability device_capability(Device device);
// Every device with a registered allocator: the CPU first, then CUDA devices.
std::vector<Device> available_devices();

class Tensor : public TensorView {
 public:
  Tensor() = default;

  // Uninitialized contiguous tensor. Throws OutOfMemory on allocation failure.
  static Tensor empty(Dims shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(Dims shape, DType dtype, Device device = Device::cpu());
  // Contiguous tensor whose physical (memory) order is `physical_shape`, viewed
  // logically through `order`: result = empty(physical).permute(inverse(order)).
  // Used for KV caches whose stride order differs from their logical shape.
  static Tensor empty_strided_order(Dims logical_shape, std::span<const int> stride_order, DType dtype,
                                    Device device);
  // Host data copied into a new tensor of `dtype` (values converted from float).
  static Tensor from_floats(std::span<const float> values, Dims shape, DType dtype,
                            Device device = Device::cpu());
  static Tensor from_i32(std::span<const std::int32_t> values, Dims shape, Device device = Device::cpu());
  static Tensor from_i64(std::span<const std::int64_t> values, Dims shape, Device device = Device::cpu());

  // Shares storage with `owner`: the view stays valid while the Tensor lives.
  Tensor(const Tensor& owner, const TensorView& view);

  Tensor select(int d, std::int64_t index) const { return {*this, TensorView::select(d, index)}; }
  Tensor slice(int d, std::int64_t start, std::int64_t end) const {
    return {*this, TensorView::slice(d, start, end)};
  }
  Tensor permute(std::initializer_list<int> order) const { return {*this, TensorView::permute(order)}; }
  Tensor permute(std::span<const int> order) const { return {*this, TensorView::permute(order)}; }
  Tensor view(Dims new_shape) const { return {*this, TensorView::view(new_shape)}; }

  // Contiguous deep copy on `device` (default: same device).
  Tensor clone() const;
  Tensor to(Device device) const;
  const std::shared_ptr<void>& storage() const { return storage_; }

 private:
  std::shared_ptr<void> storage_;
};

// A tensor over `owner`'s storage from byte `byte_offset` (aligned for
// `dtype`), laid out as empty_strided_order lays out `logical_shape`: one
// allocation can hold several tensors (a KV cache and its scales). Throws
// InvalidArgument when the region passes the owner's bytes or the order is
// not a permutation.
Tensor carve_strided_order(const Tensor& owner, std::size_t byte_offset, Dims logical_shape,
                           std::span<const int> stride_order, DType dtype);

// Strided element copy between views of equal shape and dtype (any devices the
// allocator can reach; strided device copies go through a host staging copy).
void copy_tensor(const TensorView& dst, const TensorView& src);
// Fills every element of `dst` with the float value converted to its dtype.
void fill_tensor(const TensorView& dst, float value);
// Fills every element with a raw bit pattern of the element's width (for poisoning).
void fill_tensor_bits(const TensorView& dst, std::uint64_t bits);
// Gathers a (possibly strided, any-device) view into host floats, row-major.
std::vector<float> to_float_vector(const TensorView& src);
// Gathers a view into a host vector of raw bytes, row-major, element by element.
std::vector<std::uint8_t> to_byte_vector(const TensorView& src);

// Argument checks shared by every entry point; `where` is the API name and
// `name` the argument's name in messages.
void check_dtype(const TensorView& t, std::string_view where, std::string_view name, DType expected);
void check_device(const TensorView& t, std::string_view where, std::string_view name, Device expected);
void check_rank(const TensorView& t, std::string_view where, std::string_view name, int rank);
void check_size(const TensorView& t, int d, std::string_view where, std::string_view name, std::int64_t expected);
// `dims` names expected's dimensions ("[num_blocks, num_kv_heads, block_size]")
// in the message, so a tensor laid out in another order says which one.
void check_shape(const TensorView& t, std::string_view where, std::string_view name, const Dims& expected,
                 std::string_view dims);
void check_last_dim_contiguous(const TensorView& t, std::string_view where, std::string_view name);

}  // namespace pagedattn
