// CRC-32C (csrc/src/checksum.cpp): the standard check value, the hardware and table versions
// agreeing on every length and alignment, and continuation across pieces.
#include "catch_with_torch.h"

#include <string>
#include <vector>

#include "monarch/runtime/checksum.h"

TEST_CASE("crc32c gives the standard check values", "[runtime][checksum]") {
  const std::string check = "123456789";
  CHECK(monarch::crc32c(check.data(), check.size()) == 0xE3069283u);  // RFC 3720 / the CRC catalogue
  CHECK(monarch::crc32c_portable(check.data(), check.size()) == 0xE3069283u);
  std::vector<unsigned char> zeros(32, 0);
  CHECK(monarch::crc32c(zeros.data(), zeros.size()) == 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
  CHECK(monarch::crc32c(nullptr, 0) == 0u);
}

TEST_CASE("crc32c: hardware and table agree on every length and offset, and continue across pieces",
          "[runtime][checksum]") {
  std::vector<unsigned char> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
  for (size_t offset = 0; offset < 9; ++offset) {
    for (size_t n : {0, 1, 7, 8, 9, 63, 64, 65, 991}) {
      CHECK(monarch::crc32c(data.data() + offset, n) == monarch::crc32c_portable(data.data() + offset, n));
    }
  }
  const uint32_t whole = monarch::crc32c(data.data(), data.size());
  const uint32_t first = monarch::crc32c(data.data(), 333);
  CHECK(monarch::crc32c(data.data() + 333, data.size() - 333, first) == whole);
}
