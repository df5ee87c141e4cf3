// Runs one call of a CPU kernel library built for another architecture, under qemu-user:
//
//   qemu-aarch64 -L <sysroot> kernel_driver <library.so> <request> <reply>
//
// The request names an entry point (e.g. "wkv7_forward_f32") and lists its arguments in
// order, each a one-byte tag and a value: 'P' + u64 byte count + the bytes (a buffer),
// 'I' + i64 (an int), 'D' + f64 (a double), 'Z' (a null pointer), 'A' + u64 count + that many
// 'P' or 'Z' (a pointer to an array of pointers; 'Z' and 'A' are 'P' in a signature). The
// driver checks the tags against the entry point's C signature (below), copies the buffers into
// 64-byte-aligned memory, makes the call, and writes the reply: i64 return code (0 for the void
// entry points), i64 rwkvx_simd_bytes() of the library, then every buffer again, in order (an
// array's in place), as the call left it.
// tests/ops/cross/qemu.py builds this file and speaks the protocol.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "kernel_driver: %s\n", message.c_str());
  std::exit(2);
}

// Every entry point's C signature as tags: pointers, ints, one double (delta's scale, rwkv7_out's eps).
struct Entry {
  const char* name;  // without the _f32 / _f64 suffix
  const char* tags;
};
const Entry kEntries[] = {
    {"wkv7_forward", "PPPPPPPPPPPIIIIII"},
    {"wkv7_backward", "PPPPPPPPPPPPPPPPPIIIIII"},
    {"wkv4_forward", "PPPPPPPPPPPPPIIIII"},
    {"wkv4_backward", "PPPPPPPPPPPPPPPPPPPIIIII"},
    {"rwkv8_forward", "PPPPPPPPPPPIIIIIIII"},
    {"rwkv8_backward", "PPPPPPPPPPPPPPIIIIIIII"},
    {"delta_forward", "PPPPPPPPPPIIIIIDII"},
    {"delta_backward", "PPPPPPPPPPPPPPIIIIIDII"},
    {"rwkv7_prep_forward", "PPPPPPPPPPPPPPPPPPPIIIII"},
    {"rwkv7_prep_backward", "PPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPIIIIII"},
    {"rwkv7_out_forward", "PPPPPPPPIIIID"},
    {"rwkv7_out_backward", "PPPPPPPPPPPPPIIII"},
    {"shift_mix_forward", "PPPPPPPPPPIIIIID"},
    {"shift_mix_backward", "PPPPPPPPPPPPPPPPIIIII"},
    {"channel_mix_forward", "PPIII"},
    {"channel_mix_backward", "PPPIII"},
};

template <size_t>
using Ptr = void*;
template <size_t>
using Int = int;

// A void entry point of NP pointers then NI ints, if the call has those counts.
template <size_t NP, size_t NI, size_t... P, size_t... I>
bool call_void(void* fn, const std::vector<void*>& p, const std::vector<int>& i, std::index_sequence<P...>,
               std::index_sequence<I...>) {
  if (p.size() != NP || i.size() != NI) return false;
  reinterpret_cast<void (*)(Ptr<P>..., Int<I>...)>(fn)(p[P]..., i[I]...);
  return true;
}

template <size_t NP, size_t NI>
bool call_void(void* fn, const std::vector<void*>& p, const std::vector<int>& i) {
  return call_void<NP, NI>(fn, p, i, std::make_index_sequence<NP>{}, std::make_index_sequence<NI>{});
}

// A void entry point of NP pointers, NI ints, then one double (rwkv7_out's and shift_mix's eps).
template <size_t NP, size_t NI, size_t... P, size_t... I>
bool call_void_d(void* fn, const std::vector<void*>& p, const std::vector<int>& i, double d,
                 std::index_sequence<P...>, std::index_sequence<I...>) {
  if (p.size() != NP || i.size() != NI) return false;
  reinterpret_cast<void (*)(Ptr<P>..., Int<I>..., double)>(fn)(p[P]..., i[I]..., d);
  return true;
}

template <size_t NP, size_t NI>
bool call_void_d(void* fn, const std::vector<void*>& p, const std::vector<int>& i, double d) {
  return call_void_d<NP, NI>(fn, p, i, d, std::make_index_sequence<NP>{}, std::make_index_sequence<NI>{});
}

// delta's entry points: NP pointers, five ints, the scale, two ints; returns a status.
template <size_t NP, size_t... P>
bool call_delta(void* fn, const std::vector<void*>& p, const std::vector<int>& i, double d, int64_t* rc,
                std::index_sequence<P...>) {
  if (p.size() != NP || i.size() != 7) return false;
  *rc = reinterpret_cast<int (*)(Ptr<P>..., int, int, int, int, int, double, int, int)>(fn)(
      p[P]..., i[0], i[1], i[2], i[3], i[4], d, i[5], i[6]);
  return true;
}

template <size_t NP>
bool call_delta(void* fn, const std::vector<void*>& p, const std::vector<int>& i, double d, int64_t* rc) {
  return call_delta<NP>(fn, p, i, d, rc, std::make_index_sequence<NP>{});
}

template <typename T>
T read_value(std::FILE* f) {
  T x;
  if (std::fread(&x, sizeof x, 1, f) != 1) fail("request ends early");
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) fail("usage: kernel_driver LIBRARY REQUEST REPLY");
  void* lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) fail(std::string("cannot load the library: ") + dlerror());
  std::FILE* in = std::fopen(argv[2], "rb");
  if (!in) fail("cannot open the request");
  const auto name_len = read_value<uint64_t>(in);
  std::string symbol(name_len, '\0');
  if (std::fread(&symbol[0], 1, name_len, in) != name_len) fail("request ends early");

  std::string tags;
  std::vector<void*> ptrs, buffers;  // the call's pointer arguments; every buffer, for the reply
  std::vector<uint64_t> sizes;
  std::vector<std::vector<void*>> arrays;
  auto read_buffer = [&]() {
    const auto n = read_value<uint64_t>(in);
    void* buf = std::aligned_alloc(64, (n + 63) / 64 * 64 + 64);
    if (!buf) fail("out of memory");
    if (n && std::fread(buf, 1, n, in) != n) fail("request ends early");
    buffers.push_back(buf), sizes.push_back(n);
    return buf;
  };
  std::vector<int> ints;
  double scale = 0;
  for (int tag; (tag = std::fgetc(in)) != EOF;) {
    tags += tag == 'Z' || tag == 'A' ? 'P' : (char)tag;
    if (tag == 'P') {
      ptrs.push_back(read_buffer());
    } else if (tag == 'Z') {
      ptrs.push_back(nullptr);
    } else if (tag == 'A') {
      arrays.emplace_back(read_value<uint64_t>(in));
      for (void*& element : arrays.back()) {
        const int kind = std::fgetc(in);
        if (kind != 'P' && kind != 'Z') fail("an array holds only 'P' and 'Z'");
        element = kind == 'P' ? read_buffer() : nullptr;
      }
      ptrs.push_back(arrays.back().data());
    } else if (tag == 'I') {
      ints.push_back((int)read_value<int64_t>(in));
    } else if (tag == 'D') {
      scale = read_value<double>(in);
    } else {
      fail("unknown tag in the request");
    }
  }
  std::fclose(in);

  const std::string base = symbol.substr(0, symbol.rfind('_'));
  const Entry* entry = nullptr;
  for (const Entry& e : kEntries)
    if (base == e.name) entry = &e;
  if (!entry) fail("unknown entry point " + symbol);
  if (tags != entry->tags) fail(symbol + " takes " + entry->tags + ", the request has " + tags);
  void* fn = dlsym(lib, symbol.c_str());
  if (!fn) fail("the library has no " + symbol);

  // The tags matched the entry point's signature, so exactly one call shape fits.
  int64_t rc = 0;
  const bool called = base.rfind("delta_", 0) == 0
                          ? call_delta<10>(fn, ptrs, ints, scale, &rc) || call_delta<14>(fn, ptrs, ints, scale, &rc)
                      : tags.back() == 'D'
                          ? call_void_d<8, 4>(fn, ptrs, ints, scale) || call_void_d<10, 5>(fn, ptrs, ints, scale)
                          : call_void<11, 6>(fn, ptrs, ints) || call_void<17, 6>(fn, ptrs, ints) ||
                                call_void<13, 5>(fn, ptrs, ints) ||
                                call_void<11, 8>(fn, ptrs, ints) || call_void<14, 8>(fn, ptrs, ints) ||
                                call_void<19, 5>(fn, ptrs, ints) || call_void<33, 6>(fn, ptrs, ints) ||
                                call_void<13, 4>(fn, ptrs, ints) || call_void<16, 5>(fn, ptrs, ints) ||
                                call_void<2, 3>(fn, ptrs, ints) || call_void<3, 3>(fn, ptrs, ints);
  if (!called) fail("no call shape for " + symbol);

  auto simd_bytes = reinterpret_cast<int (*)()>(dlsym(lib, "rwkvx_simd_bytes"));
  const int64_t width = simd_bytes ? simd_bytes() : -1;
  std::FILE* out = std::fopen(argv[3], "wb");
  if (!out) fail("cannot write the reply");
  std::fwrite(&rc, sizeof rc, 1, out);
  std::fwrite(&width, sizeof width, 1, out);
  for (size_t k = 0; k < buffers.size(); k++) std::fwrite(buffers[k], 1, sizes[k], out);
  if (std::fclose(out) != 0) fail("cannot write the reply");
  return 0;
}
