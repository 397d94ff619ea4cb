/*
 * engine_disk.cc — the disk tier (EBT_MEM_BACKUP_DISK): a pause writes each allocation's content to a file of its
 * own, a resume reads it back, checks it and removes the file (format and checks: memory/disk_file.h; design and
 * measurements: Note "Disk tier" in memory/NOTES.md).
 *
 * Pipeline: the content moves in chunks through a ring of pinned staging slots (arena blocks, kept between ops).
 * Pause: this thread copies chunk c device-to-host into slot c % K (D2H stream, one event per chunk) while I/O
 * threads wait for earlier chunks' copies, checksum them and write them; slot reuse waits for its last write. Resume:
 * I/O threads read and check chunks into their slots, this thread copies each to the device as it is ready; slot
 * reuse waits for the copy out of it. So device copies, checksums and disk transfers overlap, and the disk is the
 * bound (Settings: EBBTIDE_MEM_DISK_CHUNK_BYTES, EBBTIDE_MEM_DISK_THREADS).
 *
 * Policies:
 *  - A pause writes every disk backup of the op BEFORE anything is unmapped: the directory is checked (refused on
 *    tmpfs/ramfs), the free space counted, each file allocated whole (a full disk fails then), the data written and
 *    the header last. Any failure removes this op's files and leaves every allocation mapped and intact.
 *  - A resume checks every file (present, whole, this process's, this allocation's) before mapping anything, and
 *    every chunk's CRC32C before it is copied to the device; a refusal leaves the tag paused, its files kept, the
 *    resume retryable. Files go once the resume commits.
 *  - Disk phases of concurrent ops are serialised (disk_mu_): they share the staging and the disk.
 */
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/status.h"
#include "memory/disk_file.h"
#include "memory/engine.h"
#include "memory/engine_internal.h"
#include "memory/free_ranges.h"

namespace ebbtide::memory {

// One chunk of one allocation's file.
struct DiskChunk {
  size_t alloc;  // index into the op's disk allocations
  size_t index;  // chunk number within that allocation
  size_t off;    // byte offset within the allocation
  size_t n;      // bytes (the last chunk may be short)
};

// The handoff between this thread and the I/O threads: per-chunk flags, and an abort that wakes every waiter.
struct DiskHandoff {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<char> flag;
  bool aborted = false;
  explicit DiskHandoff(size_t n) : flag(n, 0) {}
  void set(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    flag[i] = 1;
    cv.notify_all();
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mu);
    aborted = true;
    cv.notify_all();
  }
  bool wait(size_t i) {  // false: aborted first
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return flag[i] || aborted; });
    return flag[i] != 0;
  }
};

namespace {

size_t up(size_t n) { return (n + disk::kBlock - 1) / disk::kBlock * disk::kBlock; }

std::vector<DiskChunk> plan_chunks(const std::vector<Allocation*>& disk, size_t chunk) {
  std::vector<DiskChunk> out;
  for (size_t i = 0; i < disk.size(); ++i)
    for (size_t off = 0, k = 0; off < disk[i]->size; off += chunk, ++k)
      out.push_back(DiskChunk{i, k, off, std::min(chunk, disk[i]->size - off)});
  return out;
}

// One device copy between a staging slot and device memory, cut where the slot's arena block crosses a host
// registration piece (each copy must lie inside one registration: HostArena::piece_remaining). The caller holds disk_mu_.
CUresult copy_slot(const ebt_driver_table_t* drv, const HostArena& arena, const HostArena::Block& block,
                          char* slot, CUdeviceptr dev, size_t n, CUstream stream, bool to_host) {
  const size_t base = static_cast<size_t>(slot - block.ptr);
  for (size_t off = 0; off < n;) {
    const size_t len = std::min(n - off, arena.piece_remaining(block, base + off));
    CUresult res = to_host ? drv->cuMemcpyDtoHAsync(slot + off, dev + off, len, stream)
                           : drv->cuMemcpyHtoDAsync(dev + off, slot + off, len, stream);
    if (res != CUDA_SUCCESS) return res;
    off += len;
  }
  return CUDA_SUCCESS;
}

}  // namespace

// The device side of one disk phase: a copy per chunk between its staging slot and the device, each followed by an
// event (events[c]) that the I/O threads wait on; `ready` tells them a chunk's copy was issued.
struct DiskCopies {
  const ebt_driver_table_t* drv;
  const std::vector<DiskChunk>& chunks;
  const std::vector<Allocation*>& disk;
  const std::vector<Device*>& dev;
  const std::vector<char*>& slot;
  std::vector<CUevent> events;
  DiskHandoff ready;
  DiskCopies(const ebt_driver_table_t* d, const std::vector<DiskChunk>& c, const std::vector<Allocation*>& a,
             const std::vector<Device*>& v, const std::vector<char*>& s)
      : drv(d), chunks(c), disk(a), dev(v), slot(s), events(c.size(), nullptr), ready(c.size()) {}
};

ebt_status_t Engine::disk_copy(DiskCopies& p, size_t c, bool to_host) {
  const DiskChunk& ch = p.chunks[c];
  Device* d = p.dev[ch.alloc];
  const size_t s = c % p.slot.size();
  CtxGuard ctx(p.drv, d->ctx);
  p.events[c] = take_event(d);
  if (!p.events[c]) return EBT_ERROR_DRIVER;
  CUstream stream = to_host ? d->d2h : d->h2d;
  CUresult res = copy_slot(p.drv, arena_, disk_staging_[s], p.slot[s], p.disk[ch.alloc]->va + ch.off, ch.n, stream,
                           to_host);
  if (res == CUDA_SUCCESS) res = p.drv->cuEventRecord(p.events[c], stream);
  if (res != CUDA_SUCCESS)
    return ebt_cu_error(res, to_host ? "cuMemcpyDtoHAsync (disk pause)" : "cuMemcpyHtoDAsync (disk resume)",
                        __FILE__, __LINE__);
  p.ready.set(c);
  return EBT_SUCCESS;
}

ebt_status_t Engine::disk_finish(DiskCopies& p, OrderedWork& io, ebt_status_t st) {
  std::string msg = st != EBT_SUCCESS ? ebt_last_error() : "";
  if (st != EBT_SUCCESS) p.ready.abort();  // I/O threads waiting for a copy stop
  ebt_status_t wst = io.join();
  if (st == EBT_SUCCESS) st = wst;
  else ebt_set_error(st, "%s", msg.c_str());
  for (size_t c = 0; c < p.chunks.size(); ++c) {
    if (!p.events[c]) continue;
    Device* d = p.dev[p.chunks[c].alloc];
    CtxGuard ctx(p.drv, d->ctx);
    CUresult res = p.drv->cuEventSynchronize(p.events[c]);  // landed: no copy still uses a slot
    if (st == EBT_SUCCESS && res != CUDA_SUCCESS)
      st = ebt_cu_error(res, "cuEventSynchronize (disk copy)", __FILE__, __LINE__);
    give_event(d, p.events[c]);
  }
  return st;
}

ebt_status_t Engine::disk_members(const std::vector<Allocation*>& allocs, bool resume, std::vector<Allocation*>* disk,
                                  std::vector<Device*>* devs, const ebt_driver_table_t** drv, DiskSettings* ds) {
  for (Allocation* a : allocs) {
    if (a->backup != EBT_MEM_BACKUP_DISK || (resume && a->disk_path.empty())) continue;
    Device* d;
    EBT_CHECK(device(a->device, &d));
    disk->push_back(a);
    devs->push_back(d);
  }
  if (disk->empty()) return EBT_SUCCESS;
  EBT_CHECK(driver(drv));
  return disk_settings(ds);
}

ebt_status_t Engine::set_disk_dir(const char* dir) {
  EBT_REQUIRE_ARG(dir && *dir, "disk backup directory must be a non-empty path");
  EBT_CHECK(disk::check_dir(dir));
  std::lock_guard<std::mutex> lock(disk_mu_);
  disk_dir_ = dir;
  disk_dir_checked_ = true;
  return EBT_SUCCESS;
}

ebt_status_t Engine::disk_dir(std::string* out) {
  std::lock_guard<std::mutex> lock(disk_mu_);
  if (disk_dir_.empty()) {
    DiskSettings ds;
    EBT_CHECK(disk_settings(&ds));
    disk_dir_ = ds.dir;
    disk_dir_checked_ = false;
  }
  *out = disk_dir_;
  return EBT_SUCCESS;
}

ebt_status_t Engine::disk_slots(const DiskSettings& ds, Device* d, std::vector<char*>* out) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  CtxGuard ctx(drv, d->ctx);
  return disk_staging(ds.chunk_bytes, static_cast<size_t>(ds.threads) * 2, d->ctx, out);
}

ebt_status_t Engine::disk_staging(size_t chunk, size_t slots, CUcontext ctx, std::vector<char*>* out) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  if (disk_staging_chunk_ != chunk || disk_staging_.size() < slots) {
    for (const auto& b : disk_staging_) arena_.free(b);
    disk_staging_.clear();
    disk_staging_chunk_ = 0;
    std::vector<size_t> sizes(slots, chunk + disk::kBlock);  // room to align each slot to kBlock
    EBT_CHECK(arena_.allocate(drv, ctx, sizes, &disk_staging_));
    disk_staging_chunk_ = chunk;
  }
  out->clear();
  for (size_t s = 0; s < slots; ++s)
    out->push_back(reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(disk_staging_[s].ptr), disk::kBlock)));
  return EBT_SUCCESS;
}

ebt_status_t Engine::disk_phase(const std::vector<Allocation*>& allocs, bool resume, ebt_mem_report_t* r) {
  std::vector<Allocation*> disk;
  std::vector<Device*> ddev;
  const ebt_driver_table_t* drv = nullptr;
  DiskSettings ds;
  EBT_CHECK(disk_members(allocs, resume, &disk, &ddev, &drv, &ds));
  if (disk.empty()) return EBT_SUCCESS;
  const auto t0 = Clock::now();
  std::string dir;
  if (!resume) EBT_CHECK(disk_dir(&dir));
  std::lock_guard<std::mutex> lock(disk_mu_);
  EBT_CHECK(resume ? disk_read(disk, ddev, drv, ds) : disk_write(disk, ddev, drv, ds, dir));
  for (Allocation* a : disk) r->bytes_disk += a->size;
  r->disk_s += since(t0);
  return EBT_SUCCESS;
}

ebt_status_t Engine::disk_write(const std::vector<Allocation*>& disk, const std::vector<Device*>& ddev,
                                const ebt_driver_table_t* drv, const DiskSettings& ds, const std::string& dir) {
  if (!disk_dir_checked_) {
    EBT_CHECK(disk::check_dir(dir));
    disk_dir_checked_ = true;
  }
  size_t need = 0, have = 0;
  for (Allocation* a : disk) need += disk::file_bytes(a->size);
  EBT_CHECK(disk::free_bytes(dir, &have));
  if (need > have)
    return ebt_set_error(EBT_ERROR_SYSTEM, "disk backup: %s has %zu bytes free, the pause needs %zu; nothing was "
                         "released", dir.c_str(), have, need);
  const size_t chunk = ds.chunk_bytes;
  std::vector<char*> slot;
  EBT_CHECK(disk_slots(ds, ddev[0], &slot));
  const size_t slots = slot.size();
  // Files first, whole: a full disk fails here.
  std::vector<std::unique_ptr<disk::File>> files(disk.size());
  auto remove_all = [&] {
    for (auto& f : files)
      if (f && !f->path().empty()) {
        f->close();
        disk::remove(f->path());
      }
  };
  for (size_t i = 0; i < disk.size(); ++i) {
    files[i] = std::make_unique<disk::File>();
    ebt_status_t st = files[i]->create(disk::file_name(dir, disk[i]->id), disk::file_bytes(disk[i]->size));
    if (st != EBT_SUCCESS) {
      files[i].reset();
      std::string msg = ebt_last_error();
      remove_all();
      return ebt_set_error(st, "%s; nothing was released", msg.c_str());
    }
    disk::track(files[i]->path(), disk::file_bytes(disk[i]->size));
  }
  const std::vector<DiskChunk> chunks = plan_chunks(disk, chunk);
  std::vector<std::vector<uint32_t>> crcs(disk.size());
  for (size_t i = 0; i < disk.size(); ++i) crcs[i].assign((disk[i]->size + chunk - 1) / chunk, 0);
  DiskCopies copies(drv, chunks, disk, ddev, slot);
  OrderedWork io;
  io.start(chunks.size(), ds.threads, runtime_worker_init(drv, ddev[0]->ctx), [&](size_t c) -> ebt_status_t {
    const DiskChunk& ch = chunks[c];
    if (!copies.ready.wait(c)) return ebt_set_error(EBT_ERROR_SYSTEM, "disk backup: stopped after an earlier failure");
    {
      CtxGuard ctx(drv, ddev[ch.alloc]->ctx);
      CUresult res = drv->cuEventSynchronize(copies.events[c]);
      if (res != CUDA_SUCCESS) return ebt_cu_error(res, "cuEventSynchronize (disk pause)", __FILE__, __LINE__);
    }
    char* buf = slot[c % slots];
    crcs[ch.alloc][ch.index] = disk::crc32c(0, buf, ch.n);
    const size_t len = up(ch.n);
    if (len > ch.n) memset(buf + ch.n, 0, len - ch.n);
    disk::File& f = *files[ch.alloc];
    EBT_CHECK(f.write_at(buf, len, static_cast<off_t>(disk::kBlock + ch.off)));
    f.drop_cache(static_cast<off_t>(disk::kBlock + ch.off), len, true);
    return EBT_SUCCESS;
  });
  ebt_status_t st = EBT_SUCCESS;
  for (size_t c = 0; c < chunks.size() && st == EBT_SUCCESS; ++c) {
    if (c >= slots) st = io.wait(c - slots);  // the slot's previous chunk is written
    if (st == EBT_SUCCESS) st = disk_copy(copies, c, true);
  }
  st = disk_finish(copies, io, st);
  std::string msg;
  // The headers, last: a file is whole only once its header is there.
  for (size_t i = 0; i < disk.size() && st == EBT_SUCCESS; ++i) {
    disk::make_header(slot[0], disk[i]->id, disk[i]->size, chunk);
    st = files[i]->write_at(slot[0], disk::kBlock, 0);
    if (st == EBT_SUCCESS) files[i]->drop_cache(0, disk::kBlock, true);
  }
  disk_direct_.store(files[0]->direct() ? 1 : 0);
  if (st != EBT_SUCCESS) {
    msg = ebt_last_error();
    remove_all();
    return ebt_set_error(st, "%s; nothing was released", msg.c_str());
  }
  for (size_t i = 0; i < disk.size(); ++i) {
    files[i]->close();
    disk[i]->disk_path = files[i]->path();
    disk[i]->disk_crc = std::move(crcs[i]);
  }
  return EBT_SUCCESS;
}

ebt_status_t Engine::disk_check(const std::vector<Allocation*>& allocs) {
  DiskSettings ds;
  std::unique_ptr<char, void (*)(void*)> scratch(nullptr, std::free);
  for (Allocation* a : allocs) {
    if (a->backup != EBT_MEM_BACKUP_DISK || a->disk_path.empty()) continue;
    if (!scratch) {
      EBT_CHECK(disk_settings(&ds));
      scratch.reset(static_cast<char*>(std::aligned_alloc(disk::kBlock, disk::kBlock)));
      if (!scratch) return ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "disk backup: no memory for a header");
    }
    disk::File f;
    EBT_CHECK(f.open_read(a->disk_path));
    const off_t want = static_cast<off_t>(disk::file_bytes(a->size));
    if (f.size() < want)
      return ebt_set_error(EBT_ERROR_INVALID_STATE,
                           "disk backup %s is truncated (%lld of %lld bytes): refused, the tag stays paused",
                           a->disk_path.c_str(), static_cast<long long>(f.size()),
                           static_cast<long long>(want));
    EBT_CHECK(f.read_at(scratch.get(), disk::kBlock, 0));
    std::string why;  // the chunk size is the process's (settings are read once), as when it was written
    if (!disk::check_header(scratch.get(), a->id, a->size, ds.chunk_bytes, &why))
      return ebt_set_error(EBT_ERROR_INVALID_STATE, "disk backup %s refused: %s; the tag stays paused",
                           a->disk_path.c_str(), why.c_str());
  }
  return EBT_SUCCESS;
}

ebt_status_t Engine::disk_read(const std::vector<Allocation*>& disk, const std::vector<Device*>& ddev,
                               const ebt_driver_table_t* drv, const DiskSettings& ds) {
  const size_t chunk = ds.chunk_bytes;
  std::vector<char*> slot;
  EBT_CHECK(disk_slots(ds, ddev[0], &slot));
  const size_t slots = slot.size();
  std::vector<std::unique_ptr<disk::File>> files(disk.size());
  for (size_t i = 0; i < disk.size(); ++i) {
    files[i] = std::make_unique<disk::File>();
    EBT_CHECK(files[i]->open_read(disk[i]->disk_path));
  }
  const std::vector<DiskChunk> chunks = plan_chunks(disk, chunk);
  DiskCopies copies(drv, chunks, disk, ddev, slot);  // ready[c]: chunk c's copy out of its slot was issued
  OrderedWork io;
  io.start(chunks.size(), ds.threads, runtime_worker_init(drv, ddev[0]->ctx), [&](size_t c) -> ebt_status_t {
    const DiskChunk& ch = chunks[c];
    if (c >= slots) {  // the slot's previous chunk must have left it
      if (!copies.ready.wait(c - slots))
        return ebt_set_error(EBT_ERROR_SYSTEM, "disk backup: stopped after an earlier failure");
      CtxGuard ctx(drv, ddev[chunks[c - slots].alloc]->ctx);
      CUresult res = drv->cuEventSynchronize(copies.events[c - slots]);
      if (res != CUDA_SUCCESS) return ebt_cu_error(res, "cuEventSynchronize (disk resume)", __FILE__, __LINE__);
    }
    char* buf = slot[c % slots];
    disk::File& f = *files[ch.alloc];
    const size_t len = up(ch.n);
    EBT_CHECK(f.read_at(buf, len, static_cast<off_t>(disk::kBlock + ch.off)));
    f.drop_cache(static_cast<off_t>(disk::kBlock + ch.off), len, false);
    const Allocation* a = disk[ch.alloc];
    if (ch.index >= a->disk_crc.size() || disk::crc32c(0, buf, ch.n) != a->disk_crc[ch.index])
      return ebt_set_error(EBT_ERROR_INVALID_STATE, "disk backup %s refused: chunk %zu (bytes %zu..%zu) is not what "
                           "was written (CRC32C); the tag stays paused", a->disk_path.c_str(), ch.index, ch.off,
                           ch.off + ch.n);
    return EBT_SUCCESS;
  });
  ebt_status_t st = EBT_SUCCESS;
  for (size_t c = 0; c < chunks.size() && st == EBT_SUCCESS; ++c) {
    st = io.wait(c);  // read and checked
    if (st == EBT_SUCCESS) st = disk_copy(copies, c, false);
  }
  st = disk_finish(copies, io, st);
  if (st != EBT_SUCCESS) return st;
  disk_direct_.store(files[0]->direct() ? 1 : 0);
  return EBT_SUCCESS;
}

void Engine::disk_forget(Allocation* a) {
  disk::remove(a->disk_path);
  a->disk_path.clear();
  a->disk_crc.clear();
}

void Engine::disk_stats(ebt_mem_global_stats_t* out) {
  disk::tracked(&out->disk_files, &out->disk_bytes);
  {
    std::lock_guard<std::mutex> lock(disk_mu_);
    for (const auto& b : disk_staging_) out->disk_staging += b.size;
  }
  out->disk_direct = disk_direct_.load();
}

}  // namespace ebbtide::memory
