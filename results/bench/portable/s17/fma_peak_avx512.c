// The AVX-512 FMA peak of one core (12 independent chains), fma_peak.c widened: gcc -O2 -mavx512f fma_peak_avx512.c -o /tmp/fma512 && /tmp/fma512
// (two at once for both cores: 225 / 224 GFLOP/s on CPU A, seventeenth session; 227 alone)
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define F(x) x=_mm512_fmadd_ps(x,b,c);
int main(){
  __m512 a0=_mm512_set1_ps(0.1f),a1=_mm512_set1_ps(0.11f),a2=_mm512_set1_ps(0.12f),a3=_mm512_set1_ps(0.13f),a4=_mm512_set1_ps(0.14f),a5=_mm512_set1_ps(0.15f),a6=_mm512_set1_ps(0.16f),a7=_mm512_set1_ps(0.17f),a8=_mm512_set1_ps(0.18f),a9=_mm512_set1_ps(0.19f),a10=_mm512_set1_ps(0.2f),a11=_mm512_set1_ps(0.21f);
  __m512 b=_mm512_set1_ps(0.9999f), c=_mm512_set1_ps(0.0001f);
  long n=100000000; struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0);
  for(long i=0;i<n;i++){ F(a0)F(a1)F(a2)F(a3)F(a4)F(a5)F(a6)F(a7)F(a8)F(a9)F(a10)F(a11) }
  clock_gettime(CLOCK_MONOTONIC,&t1); double s=(t1.tv_sec-t0.tv_sec)+1e-9*(t1.tv_nsec-t0.tv_nsec);
  __m512 acc=_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)),_mm512_add_ps(_mm512_add_ps(a4,a5),_mm512_add_ps(a6,a7)));
  acc=_mm512_add_ps(acc,_mm512_add_ps(_mm512_add_ps(a8,a9),_mm512_add_ps(a10,a11)));
  float o[16]; _mm512_storeu_ps(o,acc);
  printf("%.1f GFLOP/s per thread (%f)\n", n*12.0*32/s/1e9, o[0]);
}
