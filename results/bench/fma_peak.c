// The FMA peak of one core: 12 independent FMA chains of the widest vectors the build enables.
//   AVX2:    gcc -O2 -mavx2 -mfma results/bench/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
//   AVX-512: gcc -O2 -mavx512f results/bench/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
// Run two at once for both cores. Measured: AVX2 on CPU D (AMD EPYC Zen 3) 77-79 GFLOP/s each, 93 alone (tenth to
// fourteenth sessions; 202 for the two in the fifteenth); AVX-512 on CPU A (Intel Xeon) 225 / 224, 227 alone
// (seventeenth session).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#if defined(__AVX512F__)
typedef __m512 V;
enum { LANES = 16 };
#define SET _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define STORE _mm512_storeu_ps
#else
typedef __m256 V;
enum { LANES = 8 };
#define SET _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define STORE _mm256_storeu_ps
#endif
#define F(x) x=FMA(x,b,c);
int main(){
  V a0=SET(0.1f),a1=SET(0.11f),a2=SET(0.12f),a3=SET(0.13f),a4=SET(0.14f),a5=SET(0.15f),a6=SET(0.16f),a7=SET(0.17f),a8=SET(0.18f),a9=SET(0.19f),a10=SET(0.2f),a11=SET(0.21f);
  V b=SET(0.9999f), c=SET(0.0001f);
  long n=100000000; struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0);
  for(long i=0;i<n;i++){ F(a0)F(a1)F(a2)F(a3)F(a4)F(a5)F(a6)F(a7)F(a8)F(a9)F(a10)F(a11) }
  clock_gettime(CLOCK_MONOTONIC,&t1); double s=(t1.tv_sec-t0.tv_sec)+1e-9*(t1.tv_nsec-t0.tv_nsec);
  V acc=ADD(ADD(ADD(a0,a1),ADD(a2,a3)),ADD(ADD(a4,a5),ADD(a6,a7)));
  acc=ADD(acc,ADD(ADD(a8,a9),ADD(a10,a11)));
  float o[LANES]; STORE(o,acc);
  printf("%.1f GFLOP/s per thread, %d lanes (%f)\n", n*12.0*2*LANES/s/1e9, LANES, o[0]);
}
