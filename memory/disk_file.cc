// disk_file.cc — the disk tier's files and directory (policies in disk_file.h).
#include "memory/disk_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "csrc/status.h"

#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif
#ifndef RAMFS_MAGIC
#define RAMFS_MAGIC 0x858458f6
#endif

namespace ebbtide::memory::disk {

namespace {

// ---- CRC32C ---------------------------------------------------------------------------------------------------
uint32_t g_table[256];
std::once_flag g_table_once;
void build_table() {
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));  // reflected Castagnoli
    g_table[i] = c;
  }
}

uint32_t crc_table(uint32_t crc, const unsigned char* p, size_t n) {
  std::call_once(g_table_once, build_table);
  for (size_t i = 0; i < n; ++i) crc = g_table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t crc, const unsigned char* p, size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}
bool have_hw() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

// ---- this process ---------------------------------------------------------------------------------------------
struct Identity {
  unsigned char nonce[16];
  uint64_t pid;
};
const Identity& identity() {
  static Identity id = [] {
    Identity i;
    size_t got = 0;
    while (got < sizeof(i.nonce)) {
      ssize_t n = getrandom(i.nonce + got, sizeof(i.nonce) - got, 0);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    if (got < sizeof(i.nonce)) {  // no entropy source: time and address still tell processes apart
      uint64_t t = static_cast<uint64_t>(time(nullptr)) ^ reinterpret_cast<uintptr_t>(&i);
      memcpy(i.nonce, &t, sizeof(t));
    }
    i.pid = static_cast<uint64_t>(getpid());
    return i;
  }();
  return id;
}

constexpr char kMagic[8] = {'E', 'B', 'T', 'D', 'I', 'S', 'K', '1'};
constexpr uint32_t kVersion = 1;
struct HeaderFields {  // little-endian on every supported target
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  unsigned char nonce[16];
  uint64_t pid;
  uint64_t id;
  uint64_t size;
  uint64_t chunk;
  uint32_t crc;  // CRC32C of the fields above
};

// ---- files to remove at exit ----------------------------------------------------------------------------------
struct Registry {
  std::mutex mu;
  std::map<std::string, size_t> files;  // path -> bytes
  pid_t owner = 0;
  bool hooked = false;
};
Registry& registry() {
  static Registry* r = new Registry();  // leaked: the atexit handler may run after static destructors
  return *r;
}
void remove_at_exit() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (getpid() != r.owner) return;  // a forked child: the files are its parent's
  for (auto& kv : r.files) unlink(kv.first.c_str());
  r.files.clear();
}

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (have_hw()) return ~crc_hw(crc, p, n);
#endif
  return ~crc_table(crc, p, n);
}

ebt_status_t check_dir(const std::string& dir) {
  EBT_REQUIRE_ARG(!dir.empty() && dir[0] == '/', "disk backup directory must be an absolute path, not '%s'",
                  dir.c_str());
  for (size_t pos = 1; pos <= dir.size(); ++pos) {  // mkdir -p
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string part = dir.substr(0, pos);
    if (mkdir(part.c_str(), 0700) != 0 && errno != EEXIST)
      return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "disk backup directory %s: cannot create %s: %s", dir.c_str(),
                           part.c_str(), std::strerror(errno));
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "disk backup directory %s is not a directory", dir.c_str());
  struct statfs fs;
  if (statfs(dir.c_str(), &fs) == 0 &&
      (static_cast<unsigned long>(fs.f_type) == TMPFS_MAGIC || static_cast<unsigned long>(fs.f_type) == RAMFS_MAGIC))
    return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT,
                         "disk backup directory %s is on %s: its files would live in host memory, which a disk backup "
                         "is meant to spare; point EBBTIDE_MEM_DISK_DIR / TMS_DISK_BACKUP_DIR (or "
                         "set_disk_backup_dir) at a directory on a disk", dir.c_str(),
                         static_cast<unsigned long>(fs.f_type) == TMPFS_MAGIC ? "tmpfs" : "ramfs");
  if (access(dir.c_str(), W_OK | X_OK) != 0)
    return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "disk backup directory %s is not writable: %s", dir.c_str(),
                         std::strerror(errno));
  return EBT_SUCCESS;
}

ebt_status_t free_bytes(const std::string& dir, size_t* out) {
  struct statvfs vfs;
  if (statvfs(dir.c_str(), &vfs) != 0)
    return ebt_set_error(EBT_ERROR_SYSTEM, "statvfs(%s): %s", dir.c_str(), std::strerror(errno));
  *out = static_cast<size_t>(vfs.f_bavail) * static_cast<size_t>(vfs.f_frsize);
  return EBT_SUCCESS;
}

std::string file_name(const std::string& dir, unsigned long long id) {
  const Identity& me = identity();
  char buf[96];
  snprintf(buf, sizeof(buf), "/ebbtide-%llu-%02x%02x%02x%02x-%llu.bak", static_cast<unsigned long long>(getpid()),
           me.nonce[0], me.nonce[1], me.nonce[2], me.nonce[3], id);
  return dir + buf;
}

ebt_status_t File::open_direct(const std::string& path, int flags, const char* what) {
  close();
  path_ = path;
  direct_ = true;
  fd_ = ::open(path.c_str(), flags | O_CLOEXEC | O_DIRECT, 0600);
  if (fd_ < 0 && errno == EINVAL) {  // the filesystem takes no direct I/O
    direct_ = false;
    fd_ = ::open(path.c_str(), flags | O_CLOEXEC, 0600);
  }
  if (fd_ < 0)
    return ebt_set_error(EBT_ERROR_SYSTEM, "disk backup: cannot %s %s: %s", what, path.c_str(), std::strerror(errno));
  return EBT_SUCCESS;
}

ebt_status_t File::create(const std::string& path, size_t bytes) {
  EBT_CHECK(open_direct(path, O_RDWR | O_CREAT | O_EXCL, "create"));
  int err = posix_fallocate(fd_, 0, static_cast<off_t>(bytes));
  if (err == EOPNOTSUPP || err == EINVAL) err = ftruncate(fd_, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (err != 0) {
    ::close(fd_);
    fd_ = -1;
    unlink(path.c_str());
    return ebt_set_error(EBT_ERROR_SYSTEM, "disk backup: cannot allocate %zu bytes for %s: %s", bytes, path.c_str(),
                         std::strerror(err));
  }
  return EBT_SUCCESS;
}

ebt_status_t File::open_read(const std::string& path) { return open_direct(path, O_RDONLY, "open"); }

ebt_status_t File::transfer(char* buf, size_t n, off_t off, bool write) {
  size_t done = 0;
  while (done < n) {
    const off_t at = off + static_cast<off_t>(done);
    ssize_t k = write ? pwrite(fd_, buf + done, n - done, at) : pread(fd_, buf + done, n - done, at);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0)
      return ebt_set_error(EBT_ERROR_SYSTEM, "disk backup: %s %zu bytes at %lld of %s: %s",
                           write ? "writing" : "reading", n - done, static_cast<long long>(at), path_.c_str(),
                           k < 0 ? std::strerror(errno) : write ? "nothing written" : "the file ends early (truncated)");
    done += static_cast<size_t>(k);
  }
  return EBT_SUCCESS;
}

ebt_status_t File::write_at(const void* buf, size_t n, off_t off) {
  return transfer(const_cast<char*>(static_cast<const char*>(buf)), n, off, true);
}

ebt_status_t File::read_at(void* buf, size_t n, off_t off) { return transfer(static_cast<char*>(buf), n, off, false); }

void File::drop_cache(off_t off, size_t n, bool written) {
  if (direct_ || fd_ < 0) return;
  if (written)
    sync_file_range(fd_, off, static_cast<off_t>(n),
                    SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
  posix_fadvise(fd_, off, static_cast<off_t>(n), POSIX_FADV_DONTNEED);
}

off_t File::size() const {
  struct stat st;
  return fd_ >= 0 && fstat(fd_, &st) == 0 ? st.st_size : -1;
}

void File::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void make_header(void* buf, unsigned long long id, size_t size, size_t chunk) {
  memset(buf, 0, kBlock);
  HeaderFields h;
  memset(&h, 0, sizeof(h));
  memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kVersion;
  h.header_bytes = static_cast<uint32_t>(kBlock);
  memcpy(h.nonce, identity().nonce, sizeof(h.nonce));
  h.pid = identity().pid;
  h.id = id;
  h.size = size;
  h.chunk = chunk;
  h.crc = crc32c(0, &h, offsetof(HeaderFields, crc));
  memcpy(buf, &h, sizeof(h));
}

bool check_header(const void* buf, unsigned long long id, size_t size, size_t chunk, std::string* why) {
  HeaderFields h;
  memcpy(&h, buf, sizeof(h));
  if (memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || h.version != kVersion || h.header_bytes != kBlock) {
    *why = "it is not an ebbtide disk backup (or one left incomplete)";
    return false;
  }
  if (h.crc != crc32c(0, &h, offsetof(HeaderFields, crc))) {
    *why = "its header is damaged (checksum)";
    return false;
  }
  if (memcmp(h.nonce, identity().nonce, sizeof(h.nonce)) != 0 || h.pid != identity().pid) {
    *why = "it was written by another process (an earlier run's file is never read)";
    return false;
  }
  if (h.id != id || h.size != size || h.chunk != chunk) {
    *why = "it is the backup of another allocation";
    return false;
  }
  return true;
}

void track(const std::string& path, size_t bytes) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.hooked) {
    r.hooked = true;
    r.owner = getpid();
    atexit(remove_at_exit);
  }
  r.files[path] = bytes;
}

void remove(const std::string& path) {
  unlink(path.c_str());
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.files.erase(path);
}

void tracked(size_t* files, size_t* bytes) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  *files = r.files.size();
  *bytes = 0;
  for (auto& kv : r.files) *bytes += kv.second;
}

}  // namespace ebbtide::memory::disk
