// Dims, TensorView geometry (select/slice/permute/view), the allocator
// registry, Tensor construction and the element-wise copy/fill/gather helpers.
#include <gtest/gtest.h>
#include <pagedattn/tensor.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

namespace pagedattn {
namespace {

constexpr std::uintptr_t kCpuAlignment = 64;

std::vector<float> iota_floats(std::size_t n) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), 0.0f);
  return v;
}

// Runs `fn`, expecting an Error of `kind` whose message contains `needle`.
template <typename Fn>
void expect_error(Fn&& fn, ErrorKind kind, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(TensorDims, BasicsAndLimits) {
  Dims d{2, 3, 4};
  EXPECT_EQ(d.size(), 3);
  EXPECT_EQ(d[1], 3);
  EXPECT_EQ(d.str(), "[2, 3, 4]");
  EXPECT_EQ(Dims().str(), "[]");
  EXPECT_EQ(d, (Dims{2, 3, 4}));
  EXPECT_FALSE(d == (Dims{2, 3}));
  d.push_back(5);
  EXPECT_EQ(d, (Dims{2, 3, 4, 5}));
  const std::vector<std::int64_t> v{1, 2};
  EXPECT_EQ(Dims(std::span<const std::int64_t>(v)), (Dims{1, 2}));
  Dims full{1, 1, 1, 1, 1, 1};
  expect_error([&] { full.push_back(1); }, ErrorKind::InvalidArgument, "rank");
  expect_error([] { (void)Dims{1, 1, 1, 1, 1, 1, 1}; }, ErrorKind::InvalidArgument, "rank");
}

TEST(TensorView, ConstructionValidates) {
  float buf[24] = {};
  const TensorView t(buf, DType::F32, Device::cpu(), {2, 3, 4});
  EXPECT_EQ(t.strides(), (Dims{12, 4, 1}));
  EXPECT_TRUE(t.defined());
  EXPECT_FALSE(TensorView().defined());
  EXPECT_EQ(TensorView().numel(), 0);
  expect_error(
      [&] {
        TensorView(buf, DType::F32, Device::cpu(), {2, 3}, {3});
      },
      ErrorKind::InvalidArgument, "strides rank");
  expect_error(
      [&] {
        TensorView(buf, DType::F32, Device::cpu(), {2, -3});
      },
      ErrorKind::InvalidArgument, "shape");
  expect_error(
      [&] {
        TensorView(buf, DType::F32, Device::cpu(), {2, 3}, {3, -1});
      },
      ErrorKind::InvalidArgument, "strides");
}

TEST(TensorView, SizesStridesAndNegativeDims) {
  float buf[24] = {};
  const TensorView t(buf, DType::F32, Device::cpu(), {2, 3, 4});
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.size(-3), 2);
  EXPECT_EQ(t.stride(-2), 4);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.element_size(), 4u);
  expect_error([&] { (void)t.size(3); }, ErrorKind::InvalidArgument, "dim");
  expect_error([&] { (void)t.stride(-4); }, ErrorKind::InvalidArgument, "dim");
  EXPECT_EQ(t.data_as<float>(), buf);
  expect_error([&] { (void)t.data_as<std::int64_t>(); }, ErrorKind::InvalidArgument, "element size");
}

TEST(TensorView, ContiguityAndSpan) {
  float buf[64] = {};
  const TensorView t(buf, DType::F32, Device::cpu(), {2, 3, 4});
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.span_bytes(), 24 * sizeof(float));
  EXPECT_FALSE(t.permute({1, 0, 2}).is_contiguous());
  EXPECT_EQ(t.permute({2, 1, 0}).span_bytes(), 24 * sizeof(float));
  // Rows of a wider buffer: not contiguous, spans up to the last element.
  const TensorView rows(buf, DType::F32, Device::cpu(), {3, 4}, {10, 1});
  EXPECT_FALSE(rows.is_contiguous());
  EXPECT_EQ(rows.span_bytes(), (2 * 10 + 3 + 1) * sizeof(float));
  // Strides of size-1 dimensions do not matter; empty tensors are contiguous.
  EXPECT_TRUE(TensorView(buf, DType::F32, Device::cpu(), {1, 4}, {99, 1}).is_contiguous());
  const TensorView empty(buf, DType::F32, Device::cpu(), {0, 4});
  EXPECT_TRUE(empty.is_contiguous());
  EXPECT_EQ(empty.span_bytes(), 0u);
}

TEST(TensorView, ElementPtrSelectSlice) {
  std::vector<float> buf = iota_floats(24);
  const TensorView t(buf.data(), DType::F32, Device::cpu(), {2, 3, 4});
  const std::int64_t idx[] = {1, 2, 3};
  EXPECT_EQ(*static_cast<float*>(t.element_ptr(idx)), 23.0f);
  expect_error([&] { (void)t.element_ptr(std::span<const std::int64_t>(idx, 2)); },
               ErrorKind::InvalidArgument, "index rank");

  const TensorView s = t.select(1, 2);  // [2, 4]
  EXPECT_EQ(s.shape(), (Dims{2, 4}));
  EXPECT_EQ(s.strides(), (Dims{12, 1}));
  EXPECT_EQ(to_float_vector(s), (std::vector<float>{8, 9, 10, 11, 20, 21, 22, 23}));
  EXPECT_EQ(to_float_vector(t.select(-1, -1)), (std::vector<float>{3, 7, 11, 15, 19, 23}));
  expect_error([&] { (void)t.select(0, 2); }, ErrorKind::InvalidArgument, "index");
  expect_error([&] { (void)t.select(0, 0).select(0, 0).select(0, 0); }, ErrorKind::InvalidArgument, "rank");

  const TensorView sl = t.slice(2, 1, 3);  // [2, 3, 2]
  EXPECT_EQ(sl.shape(), (Dims{2, 3, 2}));
  EXPECT_EQ(to_float_vector(sl.select(0, 1)), (std::vector<float>{13, 14, 17, 18, 21, 22}));
  EXPECT_EQ(t.slice(0, 1, 1).numel(), 0);
  expect_error([&] { (void)t.slice(1, 2, 4); }, ErrorKind::InvalidArgument, "range");
  expect_error([&] { (void)t.slice(1, 2, 1); }, ErrorKind::InvalidArgument, "range");
}

TEST(TensorView, Permute) {
  std::vector<float> buf = iota_floats(6);
  const TensorView t(buf.data(), DType::F32, Device::cpu(), {2, 3});
  const TensorView p = t.permute({1, 0});
  EXPECT_EQ(p.shape(), (Dims{3, 2}));
  EXPECT_EQ(p.strides(), (Dims{1, 3}));
  EXPECT_EQ(to_float_vector(p), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  expect_error([&] { (void)t.permute({0, 0}); }, ErrorKind::InvalidArgument, "order");
  expect_error([&] { (void)t.permute({0}); }, ErrorKind::InvalidArgument, "order");
  expect_error([&] { (void)t.permute({0, 2}); }, ErrorKind::InvalidArgument, "order");
}

TEST(TensorView, ViewFollowsTorchStrideRules) {
  std::vector<float> buf = iota_floats(48);
  const TensorView t(buf.data(), DType::F32, Device::cpu(), {2, 3, 4});
  EXPECT_EQ(t.view({6, 4}).strides(), (Dims{4, 1}));
  EXPECT_EQ(t.view({-1}).shape(), (Dims{24}));
  EXPECT_EQ(t.view({2, -1, 2}).shape(), (Dims{2, 6, 2}));
  EXPECT_EQ(t.view({1, 24, 1}).strides(), (Dims{24, 1, 1}));
  expect_error([&] { (void)t.view({-1, -1}); }, ErrorKind::InvalidArgument, "at most one -1");
  expect_error([&] { (void)t.view({5, -1}); }, ErrorKind::InvalidArgument, "compatible");
  expect_error([&] { (void)t.view({5, 5}); }, ErrorKind::InvalidArgument, "of 24 elements");
  expect_error([&] { (void)t.view({-2, 12}); }, ErrorKind::InvalidArgument, "non-negative or -1");

  // A transpose cannot be flattened, but its untouched dimensions can be split.
  const TensorView tr = t.permute({0, 2, 1});  // [2, 4, 3] strides [12, 1, 4]
  expect_error([&] { (void)tr.view({24}); }, ErrorKind::InvalidArgument, "expressible");
  const TensorView split = tr.view({1, 2, 4, 3});
  EXPECT_EQ(split.strides(), (Dims{24, 12, 1, 4}));
  EXPECT_EQ(to_float_vector(split), to_float_vector(tr));

  // Strided rows ([4, 6] inside a row pitch of 8): the row can be split, not merged.
  const TensorView rows(buf.data(), DType::F32, Device::cpu(), {4, 6}, {8, 1});
  const TensorView rows3 = rows.view({4, 2, 3});
  EXPECT_EQ(rows3.strides(), (Dims{8, 3, 1}));
  EXPECT_EQ(to_float_vector(rows3), to_float_vector(rows));
  EXPECT_EQ(rows.view({2, 2, 6}).strides(), (Dims{16, 8, 1}));
  expect_error([&] { (void)rows.view({24}); }, ErrorKind::InvalidArgument, "expressible");

  // Empty tensors view freely.
  const TensorView empty(buf.data(), DType::F32, Device::cpu(), {0, 4});
  EXPECT_EQ(empty.view({4, 0}).shape(), (Dims{4, 0}));
  expect_error([&] { (void)empty.view({-1, 0}); }, ErrorKind::InvalidArgument, "compatible");
  expect_error([] { (void)TensorView().view({1}); }, ErrorKind::InvalidArgument, "defined");
}

TEST(TensorView, Describe) {
  std::uint16_t buf[12] = {};
  const TensorView t(buf, DType::BF16, Device::cpu(), {3, 4});
  EXPECT_EQ(t.describe(), "bf16[3, 4] strides [4, 1] cpu");
}

TEST(TensorAllocator, CpuIsBuiltIn) {
  DeviceAllocator* cpu = find_device_allocator(DeviceType::CPU);
  ASSERT_NE(cpu, nullptr);
  EXPECT_EQ(&device_allocator(DeviceType::CPU), cpu);
  EXPECT_EQ(cpu->device_count(), 1);
  EXPECT_EQ(cpu->capability(Device::cpu()), (DeviceCapability{0, 0}));
  const std::vector<Device> devices = available_devices();
  ASSERT_FALSE(devices.empty());
  EXPECT_EQ(devices.front(), Device::cpu());
  if (find_device_allocator(DeviceType::CUDA) == nullptr) {
    expect_error([] { (void)device_allocator(DeviceType::CUDA); }, ErrorKind::Unsupported, "cuda");
    expect_error([] { (void)Tensor::empty({4}, DType::F32, Device::cuda(0)); }, ErrorKind::Unsupported,
                 "cuda");
  }
  expect_error([cpu] { cpu->copy(nullptr, Device::cuda(0), nullptr, Device::cpu(), 1); },
               ErrorKind::Unsupported, "cuda:0");
}

TEST(TensorAllocator, AlignmentAndOutOfMemory) {
  for (std::int64_t n : {1, 3, 17, 1000}) {
    const Tensor t = Tensor::empty({n}, DType::U8);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % kCpuAlignment, 0u) << n;
  }
  const Tensor zero = Tensor::empty({0, 5}, DType::F32);
  EXPECT_NE(zero.data(), nullptr);
  EXPECT_EQ(zero.numel(), 0);
  constexpr std::int64_t kHuge = std::int64_t{1} << 40;  // 2^54 bytes below: beyond any address space
  expect_error([] { (void)Tensor::empty({kHuge, 1 << 12}, DType::F32); }, ErrorKind::OutOfMemory, "bytes");
  expect_error(
      [] {
        (void)Tensor::empty({kHuge, kHuge, kHuge}, DType::F32);
      },
      ErrorKind::OutOfMemory, "overflows");
}

TEST(TensorCreate, ValidatesShapeAndDevice) {
  expect_error([] { (void)Tensor::empty({}, DType::F32); }, ErrorKind::InvalidArgument, "shape rank");
  expect_error([] { (void)Tensor::empty({2, -1}, DType::F32); }, ErrorKind::InvalidArgument, "shape");
  expect_error(
      [] {
        (void)Tensor::empty({2}, DType::F32, Device{DeviceType::CPU, 1});
      },
      ErrorKind::InvalidArgument, "device index");
  const std::vector<float> three(3, 1.0f);
  expect_error(
      [&] {
        (void)Tensor::from_floats(three, {2, 2}, DType::F32);
      },
      ErrorKind::InvalidArgument, "values size");
}

TEST(TensorCreate, ZerosFromValuesAndTypes) {
  const Tensor z = Tensor::zeros({3, 5}, DType::BF16);
  EXPECT_EQ(to_float_vector(z), std::vector<float>(15, 0.0f));
  EXPECT_EQ(z.dtype(), DType::BF16);
  EXPECT_EQ(z.device(), Device::cpu());

  // Values are converted with round-to-nearest-even.
  const std::vector<float> values{1.0f, 1.0f + 1.0f / 256, 3.0f, -2.5f};
  const Tensor b = Tensor::from_floats(values, {2, 2}, DType::BF16);
  EXPECT_EQ(to_float_vector(b), (std::vector<float>{1.0f, 1.0f, 3.0f, -2.5f}));

  const std::vector<std::int32_t> i32{1, -2, 3};
  const Tensor ti = Tensor::from_i32(i32, {3});
  EXPECT_EQ(ti.dtype(), DType::I32);
  EXPECT_EQ(std::vector<std::int32_t>(ti.data_as<std::int32_t>(), ti.data_as<std::int32_t>() + 3), i32);
  const std::vector<std::int64_t> i64{std::int64_t{1} << 40, -1};
  const Tensor tl = Tensor::from_i64(i64, {2, 1});
  EXPECT_EQ(tl.shape(), (Dims{2, 1}));
  EXPECT_EQ(tl.data_as<std::int64_t>()[0], std::int64_t{1} << 40);
  expect_error([&] { (void)Tensor::from_i64(i64, {3}); }, ErrorKind::InvalidArgument, "values size");
}

TEST(TensorCreate, EmptyStridedOrderGivesHndCacheLayout) {
  constexpr std::int64_t kNB = 3, kBS = 4, kHkv = 2, kD = 8;
  const int order[] = {0, 1, 3, 2, 4};
  const Tensor kv = Tensor::empty_strided_order({2, kNB, kBS, kHkv, kD}, order, DType::F16, Device::cpu());
  EXPECT_EQ(kv.shape(), (Dims{2, kNB, kBS, kHkv, kD}));
  // Physical [2, NB, Hkv, BS, D].
  EXPECT_EQ(kv.strides(), (Dims{kNB * kHkv * kBS * kD, kHkv * kBS * kD, kD, kBS * kD, 1}));
  const Tensor k = kv.select(0, 0);
  const Tensor v = kv.select(0, 1);
  EXPECT_EQ(static_cast<std::uint8_t*>(v.data()) - static_cast<std::uint8_t*>(k.data()),
            kNB * kBS * kHkv * kD * 2);
  const int identity[] = {0, 1, 2, 3, 4};
  EXPECT_TRUE(Tensor::empty_strided_order({2, kNB, kBS, kHkv, kD}, identity, DType::F16, Device::cpu())
                  .is_contiguous());
  const int bad[] = {0, 1, 1, 2, 4};
  expect_error(
      [&] {
        (void)Tensor::empty_strided_order({2, kNB, kBS, kHkv, kD}, bad, DType::F16, Device::cpu());
      },
      ErrorKind::InvalidArgument, "stride_order");
  expect_error(
      [&] {
        (void)Tensor::empty_strided_order({2, kNB}, order, DType::F16, Device::cpu());
      },
      ErrorKind::InvalidArgument, "stride_order");
}

TEST(TensorCreate, CarveStridedOrderSharesOneAllocation) {
  constexpr std::int64_t kNB = 3, kBS = 4, kHkv = 2, kD = 8;
  constexpr std::size_t kScaleOffset = 256;
  const Tensor raw = Tensor::zeros({kScaleOffset + kNB * kBS * kHkv * 4}, DType::U8);
  const int hnd[] = {0, 2, 1, 3};
  const Tensor cache = carve_strided_order(raw, 0, {kNB, kBS, kHkv, kD}, hnd, DType::I8);
  EXPECT_EQ(cache.data(), raw.data());
  EXPECT_EQ(cache.strides(), (Dims{kHkv * kBS * kD, kD, kBS * kD, 1}));
  EXPECT_EQ(cache.storage(), raw.storage());
  const int row_major[] = {0, 1, 2};
  const Tensor scales = carve_strided_order(raw, kScaleOffset, {kNB, kBS, kHkv}, row_major, DType::F32);
  EXPECT_EQ(static_cast<const std::uint8_t*>(scales.data()) - static_cast<const std::uint8_t*>(raw.data()),
            static_cast<std::ptrdiff_t>(kScaleOffset));
  EXPECT_TRUE(scales.is_contiguous());
  expect_error([&] { (void)carve_strided_order(raw, kScaleOffset + 4, {kNB, kBS, kHkv}, row_major, DType::F32); },
               ErrorKind::InvalidArgument, "region must be within the owner's 352 bytes, got 96 bytes from byte 260");
  const int bad[] = {0, 0, 1};
  expect_error([&] { (void)carve_strided_order(raw, 0, {kNB, kBS, kHkv}, bad, DType::F32); },
               ErrorKind::InvalidArgument, "stride_order");
}

TEST(TensorCreate, ViewsShareStorage) {
  TensorView v;
  std::weak_ptr<void> weak;
  {
    const Tensor t = Tensor::from_floats(iota_floats(12), {3, 4}, DType::F32);
    const Tensor row = t.select(0, 2);
    weak = t.storage();
    v = row;
    const Tensor keep(t, row.slice(0, 1, 3));
    EXPECT_EQ(keep.storage(), t.storage());
    const Tensor reshaped = t.view({4, 3}).permute({1, 0}).slice(0, 0, 2);
    EXPECT_EQ(reshaped.storage(), t.storage());
    EXPECT_EQ(to_float_vector(reshaped), (std::vector<float>{0, 3, 6, 9, 1, 4, 7, 10}));
    EXPECT_FALSE(weak.expired());
  }
  EXPECT_TRUE(weak.expired());  // no hidden owner keeps the storage alive
}

TEST(TensorCreate, CloneIsContiguousDeepCopy) {
  const Tensor t = Tensor::from_floats(iota_floats(12), {3, 4}, DType::F32);
  const Tensor p = t.permute({1, 0});
  const Tensor c = p.clone();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_NE(c.storage(), t.storage());
  EXPECT_EQ(to_float_vector(c), to_float_vector(p));
  fill_tensor(t, 7.0f);
  EXPECT_EQ(to_float_vector(c)[1], 4.0f);
  EXPECT_EQ(to_float_vector(t.to(Device::cpu())), std::vector<float>(12, 7.0f));
  EXPECT_FALSE(Tensor().clone().defined());
}

TEST(TensorCopy, StridedCopyAndErrors) {
  const Tensor src = Tensor::from_floats(iota_floats(12), {3, 4}, DType::F16);
  const Tensor wide = Tensor::zeros({3, 6}, DType::F16);
  const Tensor dst = wide.slice(1, 1, 5);
  copy_tensor(dst, src);
  EXPECT_EQ(to_float_vector(wide),
            (std::vector<float>{0, 0, 1, 2, 3, 0, 0, 4, 5, 6, 7, 0, 0, 8, 9, 10, 11, 0}));
  const Tensor tr = Tensor::zeros({4, 3}, DType::F16);
  copy_tensor(tr.permute({1, 0}), src);
  EXPECT_EQ(to_float_vector(tr), (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  expect_error([&] { copy_tensor(tr, src); }, ErrorKind::InvalidArgument, "dst shape");
  expect_error(
      [&] {
        copy_tensor(Tensor::zeros({3, 4}, DType::BF16), src);
      },
      ErrorKind::InvalidArgument, "copy_tensor: dst dtype must be f16, got bf16");
}

TEST(TensorCopy, FillAndGather) {
  const Tensor wide = Tensor::zeros({2, 4}, DType::BF16);
  fill_tensor(wide.slice(1, 1, 3), 1.5f);
  EXPECT_EQ(to_float_vector(wide), (std::vector<float>{0, 1.5f, 1.5f, 0, 0, 1.5f, 1.5f, 0}));
  const Tensor bytes = Tensor::zeros({2, 3}, DType::I32);
  fill_tensor_bits(bytes.select(1, 1), 0xDEADBEEFu);
  const std::vector<std::uint8_t> raw = to_byte_vector(bytes);
  ASSERT_EQ(raw.size(), 24u);
  std::uint32_t word = 0;
  std::memcpy(&word, raw.data() + 4, 4);
  EXPECT_EQ(word, 0xDEADBEEFu);
  std::memcpy(&word, raw.data() + 8, 4);
  EXPECT_EQ(word, 0u);
  const Tensor fp8 = Tensor::zeros({3}, DType::FP8_E4M3);
  fill_tensor(fp8, 1000.0f);  // saturating conversion
  EXPECT_EQ(to_float_vector(fp8), std::vector<float>(3, 448.0f));
  EXPECT_TRUE(to_float_vector(TensorView()).empty());
}

// A stand-in "CUDA" device backed by host memory, so the device paths of the
// helpers (whole-span copies and host staging of strided views) run anywhere.
class HostBackedDevice final : public DeviceAllocator {
 public:
  void* allocate(std::size_t bytes, Device) override { return host().allocate(bytes, Device::cpu()); }
  void deallocate(void* p, Device) noexcept override { host().deallocate(p, Device::cpu()); }
  void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) override {
    ++copies;
    if (dst_device.is_cpu() && !src_device.is_cpu()) ++reads;
    std::memmove(dst, src, bytes);
  }
  void memset(void* dst, Device, int value, std::size_t bytes) override { std::memset(dst, value, bytes); }
  int device_count() const override { return 2; }
  DeviceCapability capability(Device) const override { return {9, 0}; }
  int copies = 0;
  int reads = 0;  // device-to-host copies

 private:
  static DeviceAllocator& host() { return device_allocator(DeviceType::CPU); }
};

class TensorDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    previous_ = find_device_allocator(DeviceType::CUDA);
    register_device_allocator(DeviceType::CUDA, &device_);
  }
  void TearDown() override { register_device_allocator(DeviceType::CUDA, previous_); }
  HostBackedDevice device_;
  DeviceAllocator* previous_ = nullptr;
};

TEST_F(TensorDeviceTest, TransfersAndStagedStridedCopies) {
  const std::vector<Device> devices = available_devices();
  ASSERT_EQ(devices.size(), 3u);
  EXPECT_EQ(devices[2], Device::cuda(1));
  expect_error([] { (void)Tensor::empty({1}, DType::F32, Device::cuda(2)); }, ErrorKind::InvalidArgument,
               "device index");

  const Tensor host = Tensor::from_floats(iota_floats(12), {3, 4}, DType::F32);
  const Tensor dev = host.to(Device::cuda(1));
  EXPECT_EQ(dev.device(), Device::cuda(1));
  EXPECT_EQ(to_float_vector(dev), to_float_vector(host));

  // Strided device destination: the gaps between the rows keep their bytes.
  const Tensor wide = Tensor::from_floats(std::vector<float>(18, -1.0f), {3, 6}, DType::F32, Device::cuda(0));
  copy_tensor(wide.slice(1, 1, 5), host.permute({1, 0}).clone().permute({1, 0}));
  EXPECT_EQ(to_float_vector(wide),
            (std::vector<float>{-1, 0, 1, 2, 3, -1, -1, 4, 5, 6, 7, -1, -1, 8, 9, 10, 11, -1}));
  // Strided device source into a host tensor, and fills through staging.
  EXPECT_EQ(to_float_vector(wide.slice(1, 5, 6)), std::vector<float>(3, -1.0f));
  fill_tensor(wide.slice(1, 0, 1), 2.0f);
  EXPECT_EQ(to_float_vector(wide.select(1, 0)), std::vector<float>(3, 2.0f));
  EXPECT_EQ(to_float_vector(wide.select(1, 1)), (std::vector<float>{0, 4, 8}));
  EXPECT_GT(device_.copies, 0);
  EXPECT_EQ(to_float_vector(Tensor::zeros({2}, DType::F16, Device::cuda(0))), std::vector<float>(2, 0.0f));
}

// Filling a gapless device view (a permuted layout such as an HND cache)
// never reads it back: its bytes may never have been written, and memory
// checkers report such reads. A view with gaps still keeps them.
TEST_F(TensorDeviceTest, GaplessDeviceFillsReadNothingBack) {
  const Tensor permuted = Tensor::empty_strided_order({2, 3, 4}, std::vector<int>{0, 2, 1}, DType::F32, Device::cuda(0));
  ASSERT_FALSE(permuted.is_contiguous());
  fill_tensor(permuted, 3.0f);
  EXPECT_EQ(device_.reads, 0);
  copy_tensor(permuted, Tensor::from_floats(iota_floats(24), {2, 3, 4}, DType::F32));
  EXPECT_EQ(device_.reads, 0);
  EXPECT_EQ(to_float_vector(permuted), iota_floats(24));

  const Tensor wide = Tensor::from_floats(std::vector<float>(6, -1.0f), {2, 3}, DType::F32, Device::cuda(0));
  const int reads_before = device_.reads;
  fill_tensor(wide.slice(1, 0, 2), 5.0f);
  EXPECT_GT(device_.reads, reads_before);
  EXPECT_EQ(to_float_vector(wide), (std::vector<float>{5, 5, -1, 5, 5, -1}));
}

TEST(TensorChecks, MessagesNameArgumentExpectedAndActual) {
  std::uint16_t buf[64] = {};
  const TensorView key(buf, DType::F16, Device::cpu(), {2, 3, 4});
  expect_error([&] { check_dtype(key, "reshape_and_cache", "key", DType::BF16); }, ErrorKind::InvalidArgument,
               "reshape_and_cache: key dtype must be bf16, got f16");
  expect_error([&] { check_device(key, "op", "key", Device::cuda(0)); }, ErrorKind::InvalidArgument,
               "op: key device must be cuda:0, got cpu");
  expect_error([&] { check_rank(key, "op", "key", 4); }, ErrorKind::InvalidArgument,
               "op: key rank must be 4, got 3 (shape [2, 3, 4])");
  expect_error([&] { check_rank(TensorView(), "op", "lse", 2); }, ErrorKind::InvalidArgument,
               "op: lse rank must be 2, got 0 (undefined)");
  expect_error([&] { check_size(key, 1, "op", "key", 8); }, ErrorKind::InvalidArgument,
               "op: key size(1) must be 8, got 3 (shape [2, 3, 4])");
  const TensorView strided(buf, DType::F16, Device::cpu(), {2, 4}, {8, 2});
  expect_error([&] { check_last_dim_contiguous(strided, "op", "value"); }, ErrorKind::InvalidArgument,
               "op: value stride(-1) must be 1");
  check_dtype(key, "op", "key", DType::F16);
  check_device(key, "op", "key", Device::cpu());
  check_rank(key, "op", "key", 3);
  check_size(key, -1, "op", "key", 4);
  check_last_dim_contiguous(key, "op", "key");
  check_last_dim_contiguous(TensorView(buf, DType::F16, Device::cpu(), {2, 1}, {8, 5}), "op", "key");
}

}  // namespace
}  // namespace pagedattn
