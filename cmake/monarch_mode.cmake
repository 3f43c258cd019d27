# monarch_mode(OUT VALUE): an AUTO | ON | OFF option's value as one of those three words (AUTO in
# any case; else CMake's booleans: 1, YES, TRUE, ON ... -> ON, the rest -> OFF).
include_guard(GLOBAL)
function(monarch_mode out value)
  string(TOUPPER "${value}" mode)
  if(NOT mode STREQUAL "AUTO")
    if(value)
      set(mode ON)
    else()
      set(mode OFF)
    endif()
  endif()
  set(${out} ${mode} PARENT_SCOPE)
endfunction()
