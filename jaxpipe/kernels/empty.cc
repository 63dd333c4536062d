// An output buffer XLA allocates and nobody writes: XLA's own "AllocateBuffer" custom call,
// which its CPU backend does not implement (`jax.lax.empty` fills zeros there).
//
//   out   any shape and dtype: left as the allocator gave it (garbage, or pages the OS has not
//         handed out yet)
//
// A pool of several GiB made by a program that writes zeros takes every page of it at once
// (XLA's CPU buffers are malloc'd, and a fill touches each page); this one takes none. The
// caller zeroes the result without touching its pages (`jaxpipe.memory.clear`: madvise).
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error EmptyImpl(ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeEmpty, EmptyImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
