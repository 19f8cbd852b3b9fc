#include "bench/roofline.h"

#include <gtest/gtest.h>

#include <cmath>

namespace pagedattn::bench {
namespace {

TEST(ReadProbeTest, EachPassReportsAFiniteRateOnAtLeastOneThread) {
  ReadProbe probe(0);
  EXPECT_EQ(probe.threads(), 1);
  for (int pass = 0; pass < 2; ++pass) {
    const double rate = probe.gb_per_s();
    EXPECT_TRUE(std::isfinite(rate));
    EXPECT_GT(rate, 0.0);
  }
}

}  // namespace
}  // namespace pagedattn::bench
