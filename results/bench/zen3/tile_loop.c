// Tile shapes of the few-row GEMM in an L1-resident loop, AVX2 (docs/heads.md, Tiles): 8 rows x 1 vector with
// broadcasts, the same with pre-broadcast inputs, 6 rows x 2 vectors. gcc -O3 -mavx2 -mfma -ffp-contract=off tile_loop.c
// -o /tmp/tile_loop && /tmp/tile_loop  (Zen 3: 56.7, 32.8 and 79.3 GFLOP/s)
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
#define K 256
float W[K*16] __attribute__((aligned(64)));
float X[K*16] __attribute__((aligned(64)));
float XB[K*8*8] __attribute__((aligned(64)));
int main(){
  for(int i=0;i<K*16;i++){W[i]=rand()/(float)RAND_MAX;X[i]=rand()/(float)RAND_MAX;}
  for(int i=0;i<K*64;i++)XB[i]=0.001f;
  long reps=200000; double t0,t; __m256 o=_mm256_setzero_ps();
  // (a) 1 w load + 8 broadcast + 8 fma, M=8 NV=1
  t0=now();
  for(long r=0;r<reps;r++){
    __m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0;
    for(int j=0;j<K;j++){ __m256 w=_mm256_loadu_ps(W+j*16); const float* x=X+j*8;
      a0=_mm256_fmadd_ps(w,_mm256_broadcast_ss(x+0),a0);a1=_mm256_fmadd_ps(w,_mm256_broadcast_ss(x+1),a1);
      a2=_mm256_fmadd_ps(w,_mm256_broadcast_ss(x+2),a2);a3=_mm256_fmadd_ps(w,_mm256_broadcast_ss(x+3),a3);
      a4=_mm256_fmadd_ps(w,_mm256_broadcast_ss(x+4),a4);a5=_mm256_fmadd_ps(w,_mm256_broadcast_ss(x+5),a5);
      a6=_mm256_fmadd_ps(w,_mm256_broadcast_ss(x+6),a6);a7=_mm256_fmadd_ps(w,_mm256_broadcast_ss(x+7),a7);}
    o=_mm256_add_ps(o,_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(a4,a5),_mm256_add_ps(a6,a7))));
  }
  t=now()-t0; printf("(a) M8 NV1 bcast: %.1f GFLOP/s\n", reps*K*8*16.0/t/1e9);
  // (b) pre-broadcast x, fma with memory operand
  t0=now();
  for(long r=0;r<reps;r++){
    __m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0;
    for(int j=0;j<K;j++){ __m256 w=_mm256_loadu_ps(W+j*16); const float* x=XB+j*64;
      a0=_mm256_fmadd_ps(w,_mm256_load_ps(x+0),a0);a1=_mm256_fmadd_ps(w,_mm256_load_ps(x+8),a1);
      a2=_mm256_fmadd_ps(w,_mm256_load_ps(x+16),a2);a3=_mm256_fmadd_ps(w,_mm256_load_ps(x+24),a3);
      a4=_mm256_fmadd_ps(w,_mm256_load_ps(x+32),a4);a5=_mm256_fmadd_ps(w,_mm256_load_ps(x+40),a5);
      a6=_mm256_fmadd_ps(w,_mm256_load_ps(x+48),a6);a7=_mm256_fmadd_ps(w,_mm256_load_ps(x+56),a7);}
    o=_mm256_add_ps(o,_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(a4,a5),_mm256_add_ps(a6,a7))));
  }
  t=now()-t0; printf("(b) M8 NV1 prebcast: %.1f GFLOP/s\n", reps*K*8*16.0/t/1e9);
  // (c) M6 NV2 broadcast
  t0=now();
  for(long r=0;r<reps;r++){
    __m256 a[12]; for(int i=0;i<12;i++)a[i]=_mm256_setzero_ps();
    __m256 a0=a[0],a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,b0=a0,b1=a0,b2=a0,b3=a0,b4=a0,b5=a0;
    for(int j=0;j<K;j++){ __m256 w=_mm256_loadu_ps(W+j*16), v=_mm256_loadu_ps(W+j*16+8); const float* x=X+j*8; __m256 s;
      s=_mm256_broadcast_ss(x+0);a0=_mm256_fmadd_ps(w,s,a0);b0=_mm256_fmadd_ps(v,s,b0);
      s=_mm256_broadcast_ss(x+1);a1=_mm256_fmadd_ps(w,s,a1);b1=_mm256_fmadd_ps(v,s,b1);
      s=_mm256_broadcast_ss(x+2);a2=_mm256_fmadd_ps(w,s,a2);b2=_mm256_fmadd_ps(v,s,b2);
      s=_mm256_broadcast_ss(x+3);a3=_mm256_fmadd_ps(w,s,a3);b3=_mm256_fmadd_ps(v,s,b3);
      s=_mm256_broadcast_ss(x+4);a4=_mm256_fmadd_ps(w,s,a4);b4=_mm256_fmadd_ps(v,s,b4);
      s=_mm256_broadcast_ss(x+5);a5=_mm256_fmadd_ps(w,s,a5);b5=_mm256_fmadd_ps(v,s,b5);}
    o=_mm256_add_ps(o,_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(a4,a5),_mm256_add_ps(b0,b1))));
    o=_mm256_add_ps(o,_mm256_add_ps(_mm256_add_ps(b2,b3),_mm256_add_ps(b4,b5)));
  }
  t=now()-t0; printf("(c) M6 NV2 bcast: %.1f GFLOP/s\n", reps*K*12*16.0/t/1e9);
  float f[8]; _mm256_storeu_ps(f,o); printf("%f\n",f[0]);
}
