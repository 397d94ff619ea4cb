// free_ranges.h — first-fit sub-allocation over a set of free [offset, offset + bytes) ranges, shared by the
// device VA space and the pinned host arena. Ranges are keyed by offset (O(log n) give-back with neighbour
// merging); callers hold their own lock.
#ifndef EBBTIDE_MEMORY_FREE_RANGES_H_
#define EBBTIDE_MEMORY_FREE_RANGES_H_

#include <cstddef>
#include <iterator>
#include <map>

namespace ebbtide::memory {

inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Take `bytes` from the first free range that holds it; true on success.
inline bool take_first_fit(std::map<size_t, size_t>& ranges, size_t bytes, size_t* offset) {
  for (auto it = ranges.begin(); it != ranges.end(); ++it) {
    if (it->second < bytes) continue;
    *offset = it->first;
    size_t rest = it->second - bytes, next = it->first + bytes;
    ranges.erase(it);
    if (rest) ranges.emplace(next, rest);
    return true;
  }
  return false;
}

// Put [offset, offset + bytes) back, merging with its neighbours.
inline void give_back(std::map<size_t, size_t>& ranges, size_t offset, size_t bytes) {
  auto next = ranges.lower_bound(offset);
  if (next != ranges.end() && offset + bytes == next->first) {
    bytes += next->second;
    next = ranges.erase(next);
  }
  if (next != ranges.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += bytes;
      return;
    }
  }
  ranges.emplace(offset, bytes);
}

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_FREE_RANGES_H_
