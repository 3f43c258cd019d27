# Finds LibTorch for the runtime (csrc/): MONARCH_WITH_TORCH = AUTO (build the runtime if
# torch is found) | ON (required) | OFF. Sets MONARCH_HAVE_TORCH.
#
# LibTorch is the one inside the installed torch package (torch.utils.cmake_prefix_path),
# which brings torch's C++ standard, ABI (_GLIBCXX_USE_CXX11_ABI) and compile definitions
# with its targets. Supported: torch 2.9 through 2.14; any other version stops the configure
# with one line saying so (MONARCH_ALLOW_ANY_TORCH=ON to try anyway).
set(MONARCH_TORCH_MIN 2.9)
set(MONARCH_TORCH_MAX 2.14)
option(MONARCH_ALLOW_ANY_TORCH "Configure against a torch outside ${MONARCH_TORCH_MIN}-${MONARCH_TORCH_MAX}" OFF)

set(MONARCH_HAVE_TORCH OFF)
include(${CMAKE_CURRENT_LIST_DIR}/monarch_mode.cmake)
monarch_mode(_monarch_torch_mode "${MONARCH_WITH_TORCH}")
if(NOT _monarch_torch_mode STREQUAL "OFF")
  if(NOT Torch_DIR)
    if(NOT Python3_EXECUTABLE)
      find_program(Python3_EXECUTABLE NAMES python3 python)
    endif()
    if(Python3_EXECUTABLE)
      execute_process(
        COMMAND "${Python3_EXECUTABLE}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
        OUTPUT_VARIABLE _monarch_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
        ERROR_QUIET RESULT_VARIABLE _monarch_torch_rc)
      if(_monarch_torch_rc EQUAL 0 AND _monarch_torch_prefix)
        list(APPEND CMAKE_PREFIX_PATH "${_monarch_torch_prefix}")
      endif()
    endif()
  endif()
  # The same interpreter for FindPython, which a CUDA build of torch's package calls too.
  if(Python3_EXECUTABLE AND NOT Python_EXECUTABLE)
    set(Python_EXECUTABLE "${Python3_EXECUTABLE}")
  endif()
  # A CUDA build of torch finds CUDA with CMake's old FindCUDA, which guesses the toolkit's root
  # from nvcc's real path (/usr/local for /usr/local/cuda-13.0/bin/nvcc); the toolkit found for
  # the kernels (cmake/monarch_cuda.cmake) is the one meant.
  if(MONARCH_HAVE_CUDA AND NOT CUDA_TOOLKIT_ROOT_DIR AND CUDAToolkit_BIN_DIR)
    get_filename_component(CUDA_TOOLKIT_ROOT_DIR "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  endif()
  # Its libraries that a machine's toolkit may lack (nvrtc) come with torch's CUDA wheels as
  # nvidia-* packages (site-packages/nvidia/*/lib): looked for there too.
  if(MONARCH_HAVE_CUDA AND Python3_EXECUTABLE AND NOT CUDA_nvrtc_LIBRARY)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
              "import os, nvidia; print(';'.join(os.path.join(p, d, 'lib') for p in nvidia.__path__ for d in sorted(os.listdir(p))))"
      OUTPUT_VARIABLE _monarch_nvidia_libs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    find_library(CUDA_nvrtc_LIBRARY NAMES nvrtc libnvrtc.so.13 libnvrtc.so.12
                 HINTS ${CUDAToolkit_LIBRARY_DIR} ${_monarch_nvidia_libs})
  endif()
  if(_monarch_torch_mode STREQUAL "AUTO")
    find_package(Torch QUIET)
  else()
    find_package(Torch)
    if(NOT TORCH_FOUND AND NOT Torch_FOUND)
      message(FATAL_ERROR "MONARCH_WITH_TORCH=ON but torch was not found: install torch "
              "${MONARCH_TORCH_MIN}-${MONARCH_TORCH_MAX} for ${Python3_EXECUTABLE} (make python does it), "
              "or set Torch_DIR")
    endif()
  endif()
  if(TORCH_FOUND OR Torch_FOUND)
    string(REGEX MATCH "^[0-9]+\\.[0-9]+" _monarch_torch_minor "${Torch_VERSION}")
    if((_monarch_torch_minor VERSION_LESS MONARCH_TORCH_MIN OR _monarch_torch_minor VERSION_GREATER MONARCH_TORCH_MAX)
       AND NOT MONARCH_ALLOW_ANY_TORCH)
      set(_monarch_torch_text "torch ${Torch_VERSION} (${Torch_DIR}) is outside the supported range "
          "${MONARCH_TORCH_MIN} through ${MONARCH_TORCH_MAX}: install a supported torch, or configure "
          "with -DMONARCH_ALLOW_ANY_TORCH=ON to try it anyway")
      if(_monarch_torch_mode STREQUAL "AUTO")  # the planner still builds
        message(WARNING ${_monarch_torch_text} " (MONARCH_WITH_TORCH=AUTO: building the planner only)")
      else()
        message(FATAL_ERROR ${_monarch_torch_text})
      endif()
    else()
      set(MONARCH_HAVE_TORCH ON)
    endif()
  endif()
endif()
