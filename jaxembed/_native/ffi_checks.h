// What every FFI handler of jaxembed's native kernels shares: shape checks whose errors name
// the value and the limit, and `Safe`, which turns a C++ exception into an ffi::Error (a
// handler never aborts the process).

#ifndef JAXEMBED_KERNELS_NATIVE_FFI_CHECKS_H_
#define JAXEMBED_KERNELS_NATIVE_FFI_CHECKS_H_

#include <cstdint>
#include <exception>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxembed {

namespace ffi = xla::ffi;

inline std::string Dims(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline ffi::Error Invalid(const char* kernel, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jaxembed native ") + kernel + ": " + what);
}

inline ffi::Error CheckShape(const char* kernel, const char* name,
                             ffi::AnyBuffer::Dimensions got, std::vector<int64_t> want) {
  bool ok = got.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = got[i] == want[i];
  if (ok) return ffi::Error::Success();
  std::string w = "[";
  for (size_t i = 0; i < want.size(); ++i) w += (i ? ", " : "") + std::to_string(want[i]);
  return Invalid(kernel, std::string(name) + " has shape " + Dims(got) + ", expected " + w + "]");
}

// A handler never lets a C++ exception (std::bad_alloc of the scratch arrays) cross into XLA:
// it becomes an ffi::Error.
template <auto Fn>
struct Safe;
template <class... Args, ffi::Error (*Fn)(Args...)>
struct Safe<Fn> {
  static ffi::Error Call(Args... args) {
    try {
      return Fn(std::move(args)...);
    } catch (const std::bad_alloc&) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jaxembed native kernel: out of memory for its scratch arrays");
    } catch (const std::exception& e) {
      return ffi::Error::Internal(std::string("jaxembed native kernel: ") + e.what());
    }
  }
};

}  // namespace jaxembed

#endif  // JAXEMBED_KERNELS_NATIVE_FFI_CHECKS_H_
