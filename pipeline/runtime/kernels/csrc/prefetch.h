// Software prefetches, for every kernel that streams data ahead of its use.
#pragma once

namespace llmp {

// Brings the 64-byte line at p into L1 (kLevel 0) or L2 (kLevel 1). Written as an asm statement because GCC
// 12 drops _mm_prefetch calls that it reaches through a lambda, without a word: the AMX tiles' weight stream
// ran without any of its prefetches that way (decoder layers of the int8 engine at 16 rows took 1.6x the
// time). p may point past any object: a prefetch never faults.
template <int kLevel>
inline void prefetch_line(const void* p) {
  static_assert(kLevel == 0 || kLevel == 1, "L1 or L2");
  if constexpr (kLevel == 0)
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  else
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
}

}  // namespace llmp
