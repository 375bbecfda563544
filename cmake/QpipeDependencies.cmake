# Third-party dependencies, found once for every component.
#
# LibTorch comes from the project virtualenv's torch wheel (tools/setup.sh passes its
# torch.utils.cmake_prefix_path as CMAKE_PREFIX_PATH). Its CUDA build probes for a GPU at
# configure time unless an architecture list is given; the H100/H200 target is Hopper.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "9.0")
endif()
find_package(Torch 2.11 REQUIRED)
set(QPIPE_HAS_CUDA OFF)
if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
  set(QPIPE_HAS_CUDA ON)
endif()
message(STATUS "qpipe: LibTorch ${Torch_VERSION}, CUDA path ${QPIPE_HAS_CUDA}")
# qpipe links LibTorch's CPU library only. Its CUDA backend (libtorch_cuda, ~365 MB resident
# once loaded) is opened at run time when a CUDA device is asked for (core/base/src/device.cpp), so
# CPU runs do not pay for it.
#
# The torch wheel's libraries export their own std::filesystem (from the toolchain they were
# built with), and calls resolved to it crash. Linking libstdc++ ahead of LibTorch puts it first
# in the dynamic linker's search order, so std:: symbols bind to the system's library.
add_library(qpipe_torch INTERFACE)
target_link_libraries(qpipe_torch INTERFACE "-Wl,--push-state,--no-as-needed" stdc++ "-Wl,--pop-state"
                      torch_cpu_library)
# at::parallel_for is a header template that splits its range over threads only where the code
# including it is compiled with OpenMP (ATen/ParallelOpenMP.h tests _OPENMP); elsewhere it runs the
# whole range on the calling thread. So qpipe and its plugins compile with OpenMP. At run time the
# one libgomp.so.1 loaded is the torch wheel's, LibTorch's own thread pool.
find_package(OpenMP REQUIRED COMPONENTS CXX)
target_link_libraries(qpipe_torch INTERFACE OpenMP::OpenMP_CXX)

# ProcessGroupGloo's header includes Gloo's, which the torch wheel does not ship (Debian's
# libgloo-dev; only the declarations are used, the code is LibTorch's own copy of Gloo).
find_path(QPIPE_GLOO_INCLUDE_DIR gloo/rendezvous/store.h)
if(NOT QPIPE_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "Gloo headers not found: install libgloo-dev (tools/setup.sh does)")
endif()

find_package(yaml-cpp REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(Boost 1.74 REQUIRED)

# The tokenizer's pre-tokenizer regexes (Unicode classes, look-ahead) and NFC normalisation.
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
