/*
 * disk_file.h — the disk tier's files (one per paused DISK allocation) and the directory they live in.
 *
 * Layout: [header: kBlock bytes][data: the allocation's bytes, padded to kBlock]. The header holds a magic, a
 * version, this process's nonce (16 random bytes drawn once) and pid, the allocation's id, size and the chunk size
 * it was written with, and a CRC32C of all that. It is written LAST, after every data chunk, so a file cut short
 * by a crash never looks whole. The CRC32C of every chunk stays in the writing process (Allocation::disk_crc): a
 * file is only ever read back by the process that wrote it, and a file from an earlier process (another nonce),
 * of another allocation, truncated, or whose chunks changed is refused.
 *
 * I/O is direct (O_DIRECT: buffers, offsets and lengths multiples of kBlock, no page cache) where the filesystem
 * takes it, else buffered with each chunk flushed and dropped from the page cache (so the host memory a disk
 * backup is meant to spare is not held by the cache instead).
 *
 * Files are removed at resume, at free and at exit (an atexit handler of the creating process: a forked child
 * exiting leaves its parent's files alone).
 */
#ifndef EBBTIDE_MEMORY_DISK_FILE_H_
#define EBBTIDE_MEMORY_DISK_FILE_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/ebbtide.h"

namespace ebbtide::memory::disk {

constexpr size_t kBlock = 4096;  // direct I/O alignment

// CRC32C (Castagnoli), continuing from `crc` (0 to start); hardware instruction where the CPU has one.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

// Bytes a file holds for an allocation of `size` bytes.
inline size_t file_bytes(size_t size) { return kBlock + (size + kBlock - 1) / kBlock * kBlock; }

// mkdir -p, then refuse (INVALID_ARGUMENT naming it) what is not a writable directory on a real filesystem:
// tmpfs or ramfs would keep the backups in host memory.
ebt_status_t check_dir(const std::string& dir);
// Bytes the directory's filesystem has free for this process.
ebt_status_t free_bytes(const std::string& dir, size_t* out);
// A new file name in `dir` for allocation `id`, unique to this process.
std::string file_name(const std::string& dir, unsigned long long id);

class File {
 public:
  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() { close(); }
  // Exclusive create, mode 0600, O_DIRECT when taken, the whole size allocated now (fallocate: a full disk fails
  // here, before any data moves); on failure nothing is left behind.
  ebt_status_t create(const std::string& path, size_t bytes);
  ebt_status_t open_read(const std::string& path);
  // Whole transfers (EINTR and short counts retried); with direct I/O `n` and `off` are multiples of kBlock.
  ebt_status_t write_at(const void* buf, size_t n, off_t off);
  ebt_status_t read_at(void* buf, size_t n, off_t off);
  // After a buffered transfer of [off, off + n): flush it (writes) and drop it from the page cache.
  void drop_cache(off_t off, size_t n, bool written);
  bool direct() const { return direct_; }
  off_t size() const;
  void close();
  const std::string& path() const { return path_; }

 private:
  // open(2) with O_DIRECT, without it where the filesystem refuses it (EINVAL); `what` names the act in errors.
  ebt_status_t open_direct(const std::string& path, int flags, const char* what);
  ebt_status_t transfer(char* buf, size_t n, off_t off, bool write);  // whole, EINTR and short counts retried
  int fd_ = -1;
  bool direct_ = false;
  std::string path_;
};

// The header of allocation `id` of `size` bytes written in `chunk`-byte chunks, into kBlock bytes at `buf`.
void make_header(void* buf, unsigned long long id, size_t size, size_t chunk);
// Whether the kBlock bytes at `buf` are that header of this process; false with the reason in *why.
bool check_header(const void* buf, unsigned long long id, size_t size, size_t chunk, std::string* why);

// The files to remove at exit (track at create, forget at removal); counts for the global stats.
void track(const std::string& path, size_t bytes);
void remove(const std::string& path);  // unlink and forget
void tracked(size_t* files, size_t* bytes);

}  // namespace ebbtide::memory::disk

#endif  // EBBTIDE_MEMORY_DISK_FILE_H_
