#pragma once
// CRC-32C (Castagnoli; iSCSI, RFC 3720 B.4): the checksum of every checkpoint slice
// (docs/checkpoints.md). Uses the SSE4.2 crc32 instruction where the CPU has it (several
// GB/s), a table otherwise; both give the same value.
#include <cstddef>
#include <cstdint>

namespace monarch {

// CRC-32C of `size` bytes at `data`, continuing from `crc` (0 to start).
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
// The table version (what crc32c uses without SSE4.2), for tests.
uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc = 0);

}  // namespace monarch
